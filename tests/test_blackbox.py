"""The black box (sparkguard.blackbox, sparkguard.guard.ring): its format on fixture bytes (round
trip, torn and hostile files), its file (lock, refusal of a foreign file), and a real daemon
SIGKILLed and started again, stopped cleanly, or finding a ring from another boot."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import zlib

import pytest

from conftest import run_sparkguard
from guardrun import GuardProc, unique
from sparkguard import blackbox, journal, sysinfo
from sparkguard.guard import ring

BOOT = "0123456789abcdef0123456789abcdef"
OTHER_BOOT = "fedcba9876543210fedcba9876543210"


def rec(seq: int, at: float = 1_800_000_000.0, boot: str = BOOT, **kw) -> blackbox.Record:
    base = dict(seq=seq, at=at + seq, mono=100.0 + seq, boot_id=boot, signal=8 << 30, mem_available=8 << 30,
                mem_free=6 << 30, swap_free=2 << 30, zram_used=1 << 20, target_mem=-1, psi_some_avg10=1.5,
                psi_full_avg10=0.25, state="ok", idle=True)
    base.update(kw)
    return blackbox.Record(**base)


def ring_bytes(records, clean: bool = False, boot: str = BOOT, slots: int = blackbox.SLOTS) -> bytearray:
    """A whole ring file as the daemon lays it out, holding ``records`` at their slots."""
    data = bytearray(blackbox.encode_header(blackbox.Header(slots, clean, boot, 1_799_999_999.0, 0.0, 4242, 1.0)))
    data += bytes(slots * blackbox.RECORD_SIZE)
    for r in records:
        at = blackbox.offset(r.seq, slots)
        data[at:at + blackbox.RECORD_SIZE] = blackbox.encode_record(r)
    return data


# ---- the format, on fixture bytes -------------------------------------------------------------


def test_header_and_records_round_trip_and_a_wrapped_ring_reads_oldest_first():
    h = blackbox.Header(blackbox.SLOTS, False, BOOT, 1.5, 0.0, 4242, 1.0)
    assert blackbox.decode_header(blackbox.encode_header(h)) == h
    assert len(blackbox.encode_header(h)) == blackbox.HEADER_SIZE
    r = rec(7, psi_full_avg10=-1.0, target_mem=3 << 30, state="term_sent", idle=False)
    raw = blackbox.encode_record(r)
    assert len(raw) == blackbox.RECORD_SIZE
    got = blackbox.decode_record(raw)
    assert got == r._replace(at=pytest.approx(r.at), mono=pytest.approx(r.mono))
    # 150 records through a 64-slot ring: the last 64 remain, in order
    recs = [rec(i) for i in range(1, 151)]
    data = ring_bytes(recs)
    assert len(data) == blackbox.file_size()
    ring_read = blackbox.decode(bytes(data))
    assert [x.seq for x in ring_read.records] == list(range(87, 151)) and ring_read.bad == 0
    assert blackbox.decode(bytes(ring_bytes([]))).records == []


def test_a_truncated_file_keeps_the_records_it_still_holds():
    data = bytes(ring_bytes([rec(i) for i in range(1, 21)]))
    cut = blackbox.HEADER_SIZE + 10 * blackbox.RECORD_SIZE + 50     # in the middle of record 11
    r = blackbox.decode(data[:cut])
    assert [x.seq for x in r.records] == list(range(1, 11))
    assert r.bad == blackbox.SLOTS - 10          # the cut record and every slot past the end
    for n in (0, 1, 8, blackbox.HEADER_SIZE - 100):
        with pytest.raises(blackbox.RingError):
            blackbox.decode(data[:n])


@pytest.mark.parametrize("where,what", [
    (0, b"NOTARING"),                     # magic
    (8, b"\x02\x00"),                     # version 2
    (12, b"\x40\x00"),                    # record size 64
    (40, b"\xff"),                        # a byte of the boot id: header CRC mismatch
])
def test_a_header_that_is_not_this_version_or_torn_is_refused_naming_why(where, what):
    data = ring_bytes([rec(1)])
    data[where:where + len(what)] = what
    with pytest.raises(blackbox.RingError):
        blackbox.decode(bytes(data))


def test_a_torn_record_or_one_in_a_slot_it_does_not_own_is_skipped_and_counted():
    data = ring_bytes([rec(i) for i in range(1, 6)])
    at = blackbox.offset(3) + 20
    data[at] ^= 0xFF                                             # torn: its CRC no longer matches
    wrong = blackbox.encode_record(rec(99))                      # 99 lives in slot 34, not 5
    data[blackbox.offset(6):blackbox.offset(6) + blackbox.RECORD_SIZE] = wrong
    r = blackbox.decode(bytes(data))
    assert [x.seq for x in r.records] == [1, 2, 4, 5] and r.bad == 2


def test_hostile_values_read_back_bounded():
    data = ring_bytes([rec(1, psi_some_avg10=float("nan"), psi_full_avg10=1e30, state="ok")])
    # a state code nobody wrote
    at = blackbox.offset(1)
    body = bytearray(data[at:at + blackbox.RECORD_SIZE])
    body[blackbox._REC.size - 2] = 200
    body[-4:] = zlib.crc32(bytes(body[:-4])).to_bytes(4, "little")
    data[at:at + blackbox.RECORD_SIZE] = body
    r = blackbox.decode(bytes(data)).records[0]
    assert r.psi_some_avg10 == -1.0 and r.psi_full_avg10 == -1.0 and r.state == "?"


@pytest.mark.parametrize("field, value", [("at", float("inf")), ("at", 1e300), ("at", -5.0), ("mono", 1e300),
                                          ("mem_available", -(1 << 40)), ("signal", 1 << 62), ("seq", 1 << 63)])
def test_a_record_with_a_value_out_of_range_is_skipped_and_counted(field, value):
    """A record with a valid CRC but a value no guard wrote (a time of 1e300, a negative
    MemAvailable) is skipped and counted like a torn one, never passed on."""
    kw = {field: value}
    seq = kw.pop("seq", 2)
    data = ring_bytes([rec(1), rec(3)])
    at = blackbox.offset(seq if seq != 1 << 63 else 2)
    data[at:at + blackbox.RECORD_SIZE] = blackbox.encode_record(rec(2, **kw)._replace(seq=seq))
    r = blackbox.decode(bytes(data))
    assert [x.seq for x in r.records] == [1, 3] and r.bad == 1
    s = blackbox.summarise(r, "hard_reset", 1_800_000_100.0, OTHER_BOOT)
    assert s["records"] == 2 and s["unreadable_slots"] == 1


def test_random_damage_never_raises_anything_but_ring_error():
    rnd = random.Random(17)
    good = bytes(ring_bytes([rec(i) for i in range(1, 40)]))
    for _ in range(400):
        data = bytearray(good[:rnd.randrange(len(good) + 1)])
        for _ in range(rnd.randrange(1, 20)):
            if data:
                data[rnd.randrange(len(data))] = rnd.randrange(256)
        try:
            r = blackbox.decode(bytes(data))
        except blackbox.RingError:
            continue
        assert len(r.records) + r.bad <= r.header.slots
        for x in r.records:
            blackbox.record_json(x)
    with pytest.raises(blackbox.RingError):
        blackbox.decode(os.urandom(9000))


def test_the_verdict_clean_stop_reboot_and_death():
    recs = [rec(i) for i in range(1, 5)]
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes(recs, clean=True))), OTHER_BOOT) is None
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes(recs, clean=True))), BOOT) is None
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes([]))), BOOT) is None
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes(recs))), OTHER_BOOT) == "hard_reset"
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes(recs))), BOOT) == "daemon_died"
    dashed = "-".join((BOOT[:8], BOOT[8:12], BOOT[12:16], BOOT[16:20], BOOT[20:]))
    assert blackbox.verdict(blackbox.decode(bytes(ring_bytes(recs))), dashed) == "daemon_died"


def test_the_summary_holds_the_lowest_and_highest_of_the_last_minute_and_the_last_ten_in_full():
    recs = [rec(i, mem_available=(100 - i) << 20, mem_free=(10 + i % 3) << 30, psi_full_avg10=float(i))
            for i in range(1, 80)]
    recs[-3] = recs[-3]._replace(mem_free=123 << 20, signal=1 << 29)
    r = blackbox.decode(bytes(ring_bytes(recs)))
    now = r.records[-1].at + 42.0
    s = blackbox.summarise(r, "hard_reset", now, OTHER_BOOT)
    assert s["cause"] == "hard_reset" and s["previous_boot_id"] == BOOT and s["boot_id"] == OTHER_BOOT
    assert s["gap_seconds"] == pytest.approx(42.0) and s["records"] == 64
    assert s["window_seconds"] == pytest.approx(60.0)
    assert s["lowest"]["mem_free_bytes"] == 123 << 20 and s["lowest"]["signal_bytes"] == 1 << 29
    assert s["lowest"]["mem_available_bytes"] == (100 - 79) << 20
    assert s["highest"]["psi_full_avg10"] == 79.0 and s["highest"]["target_mem_bytes"] is None
    assert [x["seq"] for x in s["last"]] == list(range(70, 80))
    inc = blackbox.incident(r, "hard_reset", now, "spark", OTHER_BOOT, _thresholds(), {"MemAvailable": 5})
    out = inc.to_json()
    assert out["kind"] == "unclean-shutdown" and out["outcome"] == "hard_reset"
    assert out["started_at"] == r.records[-1].at and out["ended_at"] == now
    assert [e["event"] for e in out["timeline"]] == ["last_sample", "unclean_shutdown"]
    assert out["blackbox"] == s and list(out)[-1] == "blackbox"
    assert json.loads(json.dumps(out)) == out


def _thresholds():
    from sparkguard.model import Thresholds
    return Thresholds(1 << 30, None, 5.0, "available")


# ---- the file ------------------------------------------------------------------------------------


def _written(r: ring.Ring, n: int, timeout: float = 10.0) -> None:
    """Wait until ``r``'s writer thread has written ``n`` records (its count; no event says so)."""
    deadline = time.monotonic() + timeout
    while r.written < n:
        assert time.monotonic() < deadline, f"the writer wrote {r.written} of {n} records within {timeout}s"
        time.sleep(0.005)


def test_the_file_is_locked_zeroed_at_start_and_a_foreign_file_is_left_alone(tmp_path):
    path = str(tmp_path / "bb" / "blackbox.ring")
    r1, prev, err = ring.open_ring(path, BOOT, 0.0)
    assert r1 is not None and prev is None and err is None     # a new file: nothing before
    buf = bytearray(b"MemTotal: 100 kB\nMemFree: 7 kB\nMemAvailable: 9 kB\nSwapFree: 3 kB\n")
    r1.sample(1.0, buf, len(buf), 9 * 1024, True, "ok", True, -1)
    assert r1.next_at == 1.0 + blackbox.IDLE_INTERVAL and r1.next_full_at == 1.0 + blackbox.INTERVAL
    _written(r1, 1)
    assert r1.errors == 0
    got = blackbox.decode(open(path, "rb").read()).records
    assert [(x.mem_free, x.swap_free, x.signal) for x in got] == [(7 * 1024, 3 * 1024, 12 * 1024)]
    r2, _, err = ring.open_ring(path, BOOT, 0.0)               # a second guard on the same file
    assert r2 is None and "locked" in err
    r1.close(clean=True)
    after = blackbox.decode(open(path, "rb").read())
    assert after.header.clean and after.header.stopped_at > 0 and len(after.records) == 1
    r3, prev, err = ring.open_ring(path, OTHER_BOOT, 0.0)
    assert err is None and blackbox.verdict(blackbox.decode(prev), OTHER_BOOT) is None
    assert blackbox.decode(open(path, "rb").read()).records == []  # this run's ring starts empty
    r3.close(clean=False)
    assert not blackbox.decode(open(path, "rb").read()).header.clean

    foreign = tmp_path / "notes.txt"
    foreign.write_text("someone's notes\n")
    r4, _, err = ring.open_ring(str(foreign), BOOT, 0.0)
    assert r4 is None and "not a sparkguard black box" in err and foreign.read_text() == "someone's notes\n"
    link = tmp_path / "link.ring"
    link.symlink_to(path)
    r5, _, err = ring.open_ring(str(link), BOOT, 0.0)
    assert r5 is None and "symbolic link" in err and os.path.islink(link)


def test_psi_and_zram_parsers_on_fixture_text():
    psi = bytearray(b"some avg10=12.34 avg60=1.00 avg300=0.10 total=123\nfull avg10=5.50 avg60=0.00 avg300=0.00 total=9\n")
    assert ring._avg10(psi, len(psi)) == (12.34, 5.5)
    assert ring._avg10(bytearray(b"garbage"), 7) == (-1.0, -1.0)
    bad = bytearray(b"some avg10=x avg60=1\n")
    assert ring._avg10(bad, len(bad)) == (-1.0, -1.0)


# ---- a real daemon -------------------------------------------------------------------------------


def _cfg(tmp_path, **guard) -> dict:
    return {"guard": {"poll_interval": "200ms", **guard},
            "targets": {"match": [unique("sgtest-nothing")]},     # matches no process: nothing to signal
            "incidents": {"dir": str(tmp_path / "inc"), "journal": "off"}, "metrics": {"listen": "off"}}


def _incidents(tmp_path) -> list[dict]:
    d = tmp_path / "inc"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []


def _wait_records(path, n: int, timeout: float = 20.0) -> blackbox.Ring:
    """The ring at ``path`` once it holds ``n`` records (the daemon writes one a second: no event says so)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = blackbox.decode(open(path, "rb").read())
            if len(r.records) >= n:
                return r
        except (OSError, blackbox.RingError):
            pass
        assert time.monotonic() < deadline, f"fewer than {n} records in {path} within {timeout}s"
        time.sleep(0.1)


def _start(cfg) -> GuardProc:
    g = GuardProc(cfg)
    g.wait_ready()
    return g


def test_a_sigkilled_guard_is_reported_at_the_next_start_with_its_last_samples(tmp_path):
    cfg = _cfg(tmp_path)
    path = str(tmp_path / "inc" / "blackbox.ring")
    g = _start(cfg)
    try:
        before = _wait_records(path, 2)
        g.proc.send_signal(signal.SIGKILL)             # our own child
        g.proc.wait(10)
        killed_at = time.time()
    finally:
        g.stop()
    left = blackbox.decode(open(path, "rb").read())
    assert not left.header.clean and len(left.records) >= len(before.records)
    assert _incidents(tmp_path) == []

    g2 = _start(cfg)
    try:
        g2.wait_log("black box: guard died")
    finally:
        assert g2.stop() == 0
    incs = _incidents(tmp_path)
    assert len(incs) == 1, incs
    inc = incs[0]
    bb = inc["blackbox"]
    assert inc["kind"] == "unclean-shutdown" and inc["outcome"] == "daemon_died"
    assert bb["previous_boot_id"] == bb["boot_id"] == sysinfo.boot_id()
    assert bb["records"] == len(left.records) and bb["unreadable_slots"] == 0
    assert [r["seq"] for r in bb["last"]] == [r.seq for r in left.records[-10:]]
    last = bb["last"][-1]
    assert last["at"] <= killed_at and killed_at - last["at"] < blackbox.INTERVAL + 2.0
    assert last["mem_free_bytes"] > 0 and last["state"] == "ok" and last["signal_bytes"] > 0
    assert inc["started_at"] == pytest.approx(last["at"], abs=1e-3)
    assert bb["gap_seconds"] == pytest.approx(inc["ended_at"] - last["at"], abs=0.01)
    assert bb["lowest"]["mem_available_bytes"] == min(r.mem_available for r in left.records)
    # `sparkguard incidents` reads it back from the store
    listing = run_sparkguard("incidents", "--config", g2.config_path)
    assert listing.returncode == 0 and "unclean-shutdown" in listing.stdout and "daemon_died" in listing.stdout
    shown = run_sparkguard("incidents", "--config", g2.config_path, inc["id"])
    assert "Black box" in shown.stdout and "last sample" in shown.stdout, shown.stdout

    # that second run stopped cleanly: a third start records nothing more
    g3 = _start(cfg)
    assert g3.stop() == 0
    assert len(_incidents(tmp_path)) == 1


def test_idle_records_come_every_idle_interval_whatever_the_poll_interval(tmp_path):
    """Far above the line the full pass writes the idle record (the fast path writes none): one
    every blackbox.IDLE_INTERVAL, also where poll_interval does not divide the full pass's 10 s
    (0.3 s: a full pass every 9.9 s)."""
    path = str(tmp_path / "inc" / "blackbox.ring")
    g = _start(_cfg(tmp_path, poll_interval="300ms"))
    try:
        recs = _wait_records(path, 4, timeout=45).records
    finally:
        assert g.stop() == 0
    idle = [r for r in recs if r.idle]
    assert len(idle) >= 3, recs
    gaps = [b.mono - a.mono for a, b in zip(idle, idle[1:])]
    assert all(blackbox.IDLE_INTERVAL - 1.0 < gap < blackbox.IDLE_INTERVAL + 1.0 for gap in gaps), gaps


def test_a_clean_stop_records_nothing_and_a_ring_from_another_boot_is_a_hard_reset(tmp_path):
    cfg = _cfg(tmp_path)
    path = tmp_path / "inc" / "blackbox.ring"
    g = _start(cfg)
    _wait_records(str(path), 2)
    assert g.stop() == 0
    assert blackbox.decode(path.read_bytes()).header.clean
    assert _start(cfg).stop() == 0
    assert _incidents(tmp_path) == []

    # what a box reset under the guard leaves: records of another boot, no clean stop
    path.write_bytes(bytes(ring_bytes([rec(i, at=time.time() - 300, mem_free=(100 - i) << 20, boot=OTHER_BOOT)
                                       for i in range(1, 31)], boot=OTHER_BOOT)))
    g = _start(cfg)
    try:
        g.wait_log("black box: hard reset")
    finally:
        assert g.stop() == 0
    (inc,) = _incidents(tmp_path)
    assert inc["kind"] == "unclean-shutdown" and inc["outcome"] == "hard_reset"
    assert inc["blackbox"]["previous_boot_id"] == OTHER_BOOT
    assert inc["blackbox"]["lowest"]["mem_free_bytes"] == 70 << 20
    assert inc["blackbox"]["gap_seconds"] > 200


def test_blackbox_off_writes_no_file(tmp_path):
    cfg = _cfg(tmp_path, blackbox=False)
    assert _start(cfg).stop() == 0
    assert not (tmp_path / "inc" / "blackbox.ring").exists()


def test_bad_blackbox_keys_name_file_key_and_value(tmp_path):
    for text, key in (("guard:\n  blackbox_file: relative/ring\n", "guard.blackbox_file"),
                      ("guard:\n  blackbox_sync: 2h\n", "guard.blackbox_sync"),
                      ("guard:\n  blackbox: maybe\n", "guard.blackbox")):
        p = tmp_path / "c.yaml"
        p.write_text(text)
        r = run_sparkguard("check-config", "--config", str(p))
        assert r.returncode != 0 and key in r.stderr + r.stdout and str(p) in r.stderr + r.stdout, r


def test_a_ring_path_that_cannot_be_used_leaves_the_guard_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = _cfg(tmp_path, blackbox_file=str(blocker / "ring"))     # a directory that is a file
    g = _start(cfg)
    try:
        g.wait_log("black box off")
    finally:
        assert g.stop() == 0


JOURNAL_E2E = r"""
import json, os, signal, subprocess, sys, time
import yaml
from sparkguard import blackbox
base, nothing = sys.argv[1], sys.argv[2]
inc_dir = os.path.join(base, "inc")
cfg_path = os.path.join(base, "sparkguard.yaml")
with open(cfg_path, "w") as f:
    yaml.safe_dump({"targets": {"match": [nothing]}, "metrics": {"listen": "off"},
                    "incidents": {"dir": inc_dir, "journal": "on"}}, f)
log = open(os.path.join(base, "guard.log"), "w")
def start():
    return subprocess.Popen([sys.executable, "-m", "sparkguard", "run", "--config", cfg_path], stdout=log,
                            stderr=subprocess.STDOUT)
ring = os.path.join(inc_dir, "blackbox.ring")
g = start()
deadline = time.monotonic() + 60
while True:
    try:
        if len(blackbox.decode(open(ring, "rb").read()).records) >= 2:
            break
    except (OSError, blackbox.RingError):
        pass
    assert time.monotonic() < deadline and g.poll() is None, "no records"
    time.sleep(0.1)   # one record a second: nothing to wait on
g.kill()
g.wait(10)
g = start()
rec = None
deadline = time.monotonic() + 60
while rec is None and time.monotonic() < deadline:
    for n in os.listdir(inc_dir):
        if n.endswith(".json"):
            rec = json.load(open(os.path.join(inc_dir, n)))
    time.sleep(0.05)  # the reporter thread writes the file
g.send_signal(signal.SIGTERM)
g.wait(30)
entries = []
deadline = time.monotonic() + 30
while rec and time.monotonic() < deadline:
    out = subprocess.run(["journalctl", "-o", "json", "--all", "--no-pager", "SPARKGUARD_INCIDENT=" + rec["id"]],
                         capture_output=True, text=True, timeout=30).stdout
    entries = [json.loads(l) for l in out.splitlines() if l.strip()]
    if len(entries) >= 2:
        break
    time.sleep(0.1)  # journald writes asynchronously
print(json.dumps({"rec": rec, "entries": entries, "log": open(os.path.join(base, "guard.log")).read()}))
"""


def test_the_unclean_shutdown_reaches_a_real_journald_with_its_message_id(tmp_path):
    """SIGKILL, start again, beside a real systemd-journald: the unclean_shutdown entry (its own
    MESSAGE_ID) and the report (SPARKGUARD_REPORT = the stored record) are in the journal."""
    from test_journal import run_with_journald
    p = run_with_journald(tmp_path, [sys.executable, "-c", JOURNAL_E2E, str(tmp_path), unique("sgtest-nothing")],
                          timeout=240)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads(p.stdout.strip().splitlines()[-1])
    rec = res["rec"]
    assert rec is not None and rec["kind"] == "unclean-shutdown", res["log"]
    by_event = {e["SPARKGUARD_EVENT"]: e for e in res["entries"]}
    assert {"unclean_shutdown", "report"} <= set(by_event), (sorted(by_event), res["log"])
    u = by_event["unclean_shutdown"]
    assert u["MESSAGE_ID"] == journal.MESSAGE_IDS["unclean_shutdown"] == "7bdd0f0e6aee40a2821c59306fae68cf"
    assert u["PRIORITY"] == "3" and u["SPARKGUARD_KIND"] == "unclean-shutdown"
    report = by_event["report"]
    assert json.loads(report["SPARKGUARD_REPORT"]) == rec and report["SPARKGUARD_OUTCOME"] == "daemon_died"


def test_cadence_idle_every_10s_near_the_line_every_second_and_psi_read_every_10s_when_idle(tmp_path):
    """Idle records (memory far above the line) are due IDLE_INTERVAL apart and reuse PSI/zram for
    SLOW_EVERY s; a record near the line is due INTERVAL later and reads them anew (real files)."""
    psi = tmp_path / "pressure"
    psi.write_text("some avg10=1.00 avg60=0 avg300=0 total=1\nfull avg10=0.50 avg60=0 avg300=0 total=1\n")
    r, _, err = ring.open_ring(str(tmp_path / "b.ring"), BOOT, 0.0, psi_path=str(psi),
                               sys_block=str(tmp_path / "nosys"))
    assert err is None
    buf = bytearray(b"MemTotal: 100 kB\nMemFree: 7 kB\nMemAvailable: 9 kB\nSwapFree: 3 kB\n")
    try:
        assert r.sample(100.0, buf, len(buf), 9216, False, "ok", True, -1) == 100.0 + blackbox.IDLE_INTERVAL
        psi.write_text("some avg10=42.00 avg60=0 avg300=0 total=9\nfull avg10=21.00 avg60=0 avg300=0 total=9\n")
        r.sample(105.0, buf, len(buf), 9216, False, "ok", True, -1)             # idle, 5 s later: PSI kept
        r.sample(110.0, buf, len(buf), 9216, False, "ok", True, -1)             # idle, 10 s later: read
        assert r.sample(110.5, buf, len(buf), 9216, False, "term_sent", False, 5 << 30) == 111.5
        assert r.next_full_at == 110.5 + blackbox.INTERVAL
        _written(r, 4)
        recs = blackbox.decode(open(tmp_path / "b.ring", "rb").read()).records
        assert [(x.psi_some_avg10, x.psi_full_avg10, x.idle) for x in recs] == [
            (1.0, 0.5, True), (1.0, 0.5, True), (42.0, 21.0, True), (42.0, 21.0, False)]
        assert recs[2].mem_available == 9216 and recs[2].signal == 9216     # parsed from buf
        assert recs[-1].state == "term_sent" and recs[-1].target_mem == 5 << 30 and recs[-1].zram_used == -1
    finally:
        r.close()


def test_the_flusher_runs_near_the_line_and_ends_with_close(tmp_path, monkeypatch):
    """The writer thread starts writeback (ring.flush) every blackbox_sync s once a record is near
    the line, and not while records are idle; close() ends it."""
    import threading
    flushes = []
    real_flush = ring.flush
    monkeypatch.setattr(ring, "flush", lambda fd: (flushes.append(time.monotonic()), real_flush(fd)))
    r, _, err = ring.open_ring(str(tmp_path / "b.ring"), BOOT, 0.01)
    assert err is None
    buf = bytearray(b"MemTotal: 100 kB\nMemFree: 7 kB\nMemAvailable: 9 kB\n")

    def writers():
        return [t for t in threading.enumerate() if t.name == "sparkguard-blackbox"]
    try:
        assert len(writers()) == 1
        r.sample(1.0, buf, len(buf), 9216, False, "ok", True, -1)    # idle: written, not flushed
        _written(r, 1)
        assert flushes == []
        r.sample(2.0, buf, len(buf), 9216, False, "ok", False, -1)   # near the line: flushed
        deadline = time.monotonic() + 10
        while not flushes:
            assert time.monotonic() < deadline, "the writer did not flush near the line"
            time.sleep(0.01)
        assert r.written == 2
    finally:
        r.close()
    for t in writers():
        t.join(5)
    assert writers() == []


def test_zram_ram_used_is_summed_over_devices_with_a_disksize(tmp_path):
    """A fixture /sys/block: zram0 and zram2 hold data (mm_stat column 3, mem_used_total), zram1 has
    no disksize and is left out.  Source: Documentation/admin-guide/blockdev/zram.rst."""
    for name, size, used in (("zram0", 1 << 30, 4096), ("zram1", 0, 999), ("zram2", 1 << 30, 8192)):
        d = tmp_path / "block" / name
        d.mkdir(parents=True)
        (d / "disksize").write_text(f"{size}\n")
        (d / "comp_algorithm").write_text("lzo [lz4] zstd\n")
        (d / "mm_stat").write_text(f"  100   50  {used}  0  {used}  0  0  0  0\n")
    r, _, err = ring.open_ring(str(tmp_path / "b.ring"), BOOT, 0.0, sys_block=str(tmp_path / "block"))
    assert err is None
    try:
        assert r._zram() == 4096 + 8192
    finally:
        r.close()


def test_a_zram_device_set_up_after_the_start_is_counted_from_the_next_listing(tmp_path):
    """A boot's zram swap may come up after the guard: the ring lists the devices again every
    ZRAM_RELIST seconds (FIELD-NOTES: swap added after start must not go unnoticed)."""
    import time as _time
    block = tmp_path / "block"
    block.mkdir()
    r, _, err = ring.open_ring(str(tmp_path / "b.ring"), BOOT, 0.0, sys_block=str(block))
    assert err is None
    try:
        text = b"MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 20 kB\nSwapFree: 0 kB\n"
        t0 = _time.monotonic()
        r.sample(t0, text, len(text), 20480, False, "ok", False, -1)
        assert r._zram_used == -1                         # no zram yet
        d = block / "zram0"
        d.mkdir()
        (d / "disksize").write_text(f"{1 << 30}\n")
        (d / "comp_algorithm").write_text("[lz4] zstd\n")
        (d / "mm_stat").write_text("  100   50  12288  0  12288  0  0  0  0\n")
        r.sample(t0 + 1, text, len(text), 20480, False, "ok", False, -1)
        assert r._zram_used == -1                         # listed again only after ZRAM_RELIST
        r.sample(t0 + ring.ZRAM_RELIST + 1, text, len(text), 20480, False, "ok", False, -1)
        assert r._zram_used == 12288 and len(r._zram_fds) == 1
        r.sample(t0 + 2 * ring.ZRAM_RELIST + 2, text, len(text), 20480, False, "ok", False, -1)
        assert len(r._zram_fds) == 1 and r.errors == 0   # the last listing's descriptors closed, not kept
    finally:
        r.close()


# ---- a corrupted or foreign black box (issue 32, class 5) -----------------------------------------


def test_a_ring_whose_record_holds_an_absurd_time_never_stops_the_start(tmp_path):
    """Well-formed records (valid CRCs) of a run that did not stop cleanly, the newest with a time
    of 1e300: the daemon starts, skips and counts that record, and reports the others."""
    cfg = _cfg(tmp_path)
    path = tmp_path / "inc" / "blackbox.ring"
    path.parent.mkdir(parents=True)
    recs = [rec(i, at=time.time() - 300, boot=OTHER_BOOT) for i in range(1, 6)]
    recs.append(rec(6, boot=OTHER_BOOT)._replace(at=1e300))
    path.write_bytes(bytes(ring_bytes(recs, boot=OTHER_BOOT)))
    g = GuardProc(cfg)
    try:
        g.wait_ready(timeout=30)
        g.wait_log("black box: hard reset")
        assert g.proc.poll() is None
    finally:
        rc = g.stop()
    assert rc == 0 and "Traceback" not in g.log(), g.log()[-3000:]
    (inc,) = _incidents(tmp_path)
    assert inc["blackbox"]["records"] == 5 and inc["blackbox"]["unreadable_slots"] == 1
    assert [r["seq"] for r in inc["blackbox"]["last"]] == [1, 2, 3, 4, 5]


FOREIGN = {
    "starts with zero bytes": lambda p: p.write_bytes(bytes(8) + b"someone's data " * 40),
    "another user's ring": lambda p: (p.write_bytes(bytes(ring_bytes([rec(1)]))), os.chown(p, 65534, 65534)),
    "world-writable": lambda p: (p.write_bytes(bytes(ring_bytes([rec(1)]))), os.chmod(p, 0o666)),
    "a FIFO": lambda p: os.mkfifo(p, 0o600),
}


@pytest.mark.parametrize("what", list(FOREIGN))
def test_a_foreign_file_at_the_rings_path_is_left_byte_for_byte_and_named(tmp_path, what):
    """A file at the ring's path that is not this daemon's ring is named in the log and left
    exactly as it was; the guard runs without a black box."""
    if os.geteuid() != 0 and what == "another user's ring":
        pytest.skip("needs root to give the file to another user")
    cfg = _cfg(tmp_path)
    path = tmp_path / "inc" / "blackbox.ring"
    path.parent.mkdir(parents=True)
    FOREIGN[what](path)
    st = os.lstat(path)
    before = path.read_bytes() if what != "a FIFO" else None
    g = GuardProc(cfg)
    try:
        g.wait_ready(timeout=30)
        g.wait_log(f"black box off: {path}")
        assert "left alone" in g.log() and g.proc.poll() is None
    finally:
        rc = g.stop()
    assert rc == 0 and "Traceback" not in g.log(), g.log()[-3000:]
    after = os.lstat(path)
    assert (after.st_ino, after.st_uid, after.st_mode, after.st_size, after.st_mtime_ns) == \
        (st.st_ino, st.st_uid, st.st_mode, st.st_size, st.st_mtime_ns)
    if before is not None:
        assert path.read_bytes() == before


def test_an_all_zero_ring_left_by_a_cut_short_start_is_taken(tmp_path):
    """A file of zeros no larger than a ring (what a start cut short between the truncate and
    the header can leave) holds nothing of anyone's: it becomes this run's ring."""
    path = tmp_path / "blackbox.ring"
    path.write_bytes(bytes(blackbox.file_size()))
    r, prev, err = ring.open_ring(str(path), BOOT, 0.0)
    try:
        assert err is None and r is not None
    finally:
        r.close()

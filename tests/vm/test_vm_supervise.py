"""An engine under supervision survives memory exhaustion, and a hard reset mid-incident is reported (issue 19).

In the session's QEMU guest (Debian 12, its kernel, systemd as PID 1, the seed's zram and sysctls
live through ``sparkguard-setup.service``), as a user sets it up: ``sparkguard install
--engine-sandbox``, a config whose ``engine.command`` is the fake vLLM (``tests/fakes/``, copied in as
``tests/system/nspawn.Container.copy_fakes`` does; it behaves as vLLM does on SIGTERM, FIELD-NOTES),
``systemctl enable --now sparkguard``.  Then:

1. a memory hog the test starts (random, page-incompressible bytes, so that zram cannot make room)
   takes MemAvailable below the guard's line; the guard SIGTERMs the engine (its ``sigterm``
   journal entry, MESSAGE_ID of :data:`sparkguard.journal.MESSAGE_IDS`); the test ends its hog
   (memory back); the supervisor starts the engine again once the quiesce gate
   (``engine.start_above``) sees the memory, and the new engine answers ``/health`` 200 inside the
   guest; the incident's report is in the journal (``journalctl -o json``, MESSAGE_ID);
2. the hog again, and while that incident is open (SIGTERM sent, the engine still tearing down:
   ``--exit-delay``) QEMU's ``system_reset``: no shutdown, whatever the guest had not written to its
   disk is lost (QEMU keeps the ``snapshot=on`` overlay across a guest reset);
3. the next boot: the guard (enabled) finds its black box not closed cleanly and records an
   ``unclean-shutdown`` incident, outcome ``hard_reset``, with the previous boot's last samples
   (on the disk: the fill's approach to the line up to :data:`APPROACH_LOST` s before the SIGTERM;
   the records after the last writeback are lost with the reset, docs/blackbox.md), shown by
   ``sparkguard incidents`` and in the journal; the first incident's report is still readable
   in the persistent journal (/var/log/journal, made by tests/vm/image.py) under the previous boot's
   id; the engine is started again at boot and serves.

Sizes are relative to what the guest reads: the guard's line is the default 0.75 GiB, the hog
takes what is available above it plus :data:`OVERSHOOT`, so the crossing happens whatever the
guest's idle MemAvailable; the engine holds :data:`ENGINE_HOLDS`, which comes back on its exit.
"""

from __future__ import annotations

import json
import time

import pytest

from sparkguard import journal
from sparkguard.units import parse_size
from system import nspawn
from waiting import wait_for as _wait_for
from .conftest import VENV

pytestmark = [pytest.mark.system, pytest.mark.vm]

UNIT = "sparkguard.service"
PY = f"{VENV}/bin/python3"
PORT = 8000
HEALTH = f"http://127.0.0.1:{PORT}/health"
CONFIG = "/etc/sparkguard/sparkguard.yaml"
LINE = parse_size("0.75GiB")         # guard.term_below's default (README, "Configuration")
MiB = 1 << 20
#: each of the fake's two workers holds this (its top and EngineCore 16 + 32 MiB more)
WORKER_HOLD = 128 * MiB
ENGINE_HOLDS = 2 * WORKER_HOLD + 48 * MiB
#: how far below the line the hog takes MemAvailable (less than ENGINE_HOLDS: the engine's exit
#: brings memory back above the line, so the first incident ends as "recovered")
OVERSHOOT = 96 * MiB
#: the hog's fill rate: slow enough under TCG that the black box writes several samples near
#: the line before the crossing (one a second, docs/blackbox.md)
HOG_RATE = 128 * MiB
#: the engine takes this long to exit after SIGTERM (CUDA teardown in a real vLLM: FIELD-NOTES,
#: 1.2-1.8 s on an H200); long enough that the reset lands inside the open incident
EXIT_DELAY = "4s"
#: how much before the SIGTERM the black box on the disk may end: its flusher starts writeback every
#: guard.blackbox_sync (1 s) while memory is near the line and a record is written once a second
#: (docs/blackbox.md, "What a reset loses"), plus 3 s for an emulated disk on a loaded host
APPROACH_LOST = 5.0
HOG = r"""
import os, sys, time
size, rate = int(sys.argv[1]), int(sys.argv[2])
block = os.urandom(1 << 20)           # random: every 4 KiB page is incompressible to zram's lz4
held, t0 = [], time.monotonic()
while len(held) < size >> 20:
    held.append(bytearray(block))
    ahead = len(held) * (1 << 20) / rate - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)
print("held", flush=True)
while True:
    time.sleep(3600)
"""
#: inside: GET argv[1], print the status code (0 when nothing answers)
GET = r"""
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except Exception as e:
    print(getattr(e, "code", 0))
"""


def wait_for(what: str, probe, timeout: float, interval: float = 0.5):
    """:func:`waiting.wait_for` at a VM's pace: each probe is a command the guest's agent runs
    on an emulated CPU (every 0.5 s unless told)."""
    return _wait_for(what, probe, timeout, interval)


def mem_available(vm) -> int:
    for ln in vm.run("cat", "/proc/meminfo").stdout.splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) * 1024
    raise AssertionError("no MemAvailable in the guest's /proc/meminfo")


def engine_status(vm) -> dict:
    r = vm.run(PY, "-m", "sparkguard", "engine", "status", "--json", check=False, timeout=60)
    try:
        return json.loads(r.stdout).get("status") or {}
    except ValueError:
        return {}


def health(vm) -> int:
    return int(vm.run("python3", "-c", GET, HEALTH, timeout=30).stdout.strip() or 0)


def entries(vm, event: str, *args: str) -> list[dict]:
    """The guest's journal entries of sparkguard's ``event`` (MESSAGE_ID), all boots unless ``args`` say."""
    r = vm.run("journalctl", "-o", "json", "--no-pager", f"MESSAGE_ID={journal.MESSAGE_IDS[event]}", *args,
               check=False, timeout=120)
    out = []
    for ln in r.stdout.splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass
    return out


def ready_engine(vm, not_pid: int | None, timeout: float) -> dict:
    """The engine's status once a run other than ``not_pid`` is ready and /health answers 200."""
    def ready():
        st = engine_status(vm)
        return st if st.get("state") == "ready" and st.get("pid") not in (None, not_pid) and health(vm) == 200 else None
    return wait_for("the engine ready and serving /health", ready, timeout=timeout, interval=1.0)


def guard_sigterm(vm, pid: int) -> list[dict]:
    """The guard's ``sigterm`` entries of this boot that name engine ``pid`` as the target's root."""
    return [e for e in entries(vm, "sigterm", "-b") if f"(pid {pid}," in str(e.get("MESSAGE"))]


def start_hog(vm) -> tuple[int, int]:
    """Start the hog at MemAvailable - LINE + OVERSHOOT bytes; returns (its pid, its size)."""
    size = mem_available(vm) - LINE + OVERSHOOT
    assert size > 0, f"MemAvailable already below the line {LINE}"
    pid = int(vm.sh(f"python3 /var/tmp/sg-fill.py {size} {HOG_RATE} > /var/tmp/sg-fill.out 2>&1 & echo $!").stdout)
    return pid, size


def test_a_supervised_engine_survives_exhaustion_and_a_hard_reset_is_reported(vm):
    # -- set up as a user would: install, the engine in the config, enable --now
    r = vm.run(f"{VENV}/bin/sparkguard", "install", "--engine-sandbox", check=False, timeout=300)
    assert r.returncode == 0, f"sparkguard install failed:\n{r.stdout}\n{r.stderr}"
    for name, mode in nspawn.FAKE_FILES:
        vm.put(f"{nspawn.FAKES_IN}/{name}", (nspawn.CHECKOUT / "tests" / "fakes" / name).read_bytes(), mode)
    vm.put("/var/tmp/sg-fill.py", HOG.encode())
    idle = mem_available(vm)
    # the quiesce gate: the engine starts once MemAvailable is back half way between the line and idle
    start_above = (LINE + idle) // 2
    assert start_above > LINE + ENGINE_HOLDS, f"the guest has too little memory for this test: {idle} available"
    engine = {"command": [PY, f"{nspawn.FAKES_IN}/vllm", "serve", "sgvm-model", "--port", str(PORT),
                          "--hold", str(WORKER_HOLD), "--exit-delay", EXIT_DELAY],
              "health_url": HEALTH, "health_interval": "500ms", "start_above": str(start_above),
              "stable_for": "2s"}
    vm.put(CONFIG, ("engine: " + json.dumps(engine) + "\n").encode())
    r = vm.run(PY, "-m", "sparkguard", "check-config", CONFIG, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    vm.run("systemctl", "enable", "--now", UNIT, timeout=300)
    first = ready_engine(vm, None, timeout=300)
    boot1 = vm.boot_id.replace("-", "")

    # -- 1. exhaustion: the guard TERMs the engine; the hog ends; the engine is back and serving
    hog, size = start_hog(vm)
    term = wait_for("the guard's SIGTERM of the engine", lambda: guard_sigterm(vm, first["pid"]), timeout=180)
    vm.run("kill", str(hog))
    wait_for("the hog's exit", lambda: vm.run("kill", "-0", str(hog), check=False).returncode != 0, timeout=60)
    second = ready_engine(vm, first["pid"], timeout=300)
    assert second.get("restarts", {}).get("guard") == 1, second
    report = wait_for("the incident's report in the journal", lambda: entries(vm, "report", "-b"), timeout=120)
    print(f"[vm] hog {size >> 20} MiB; SIGTERM: {term[0]['MESSAGE'][:160]}; engine {first['pid']} -> "
          f"{second['pid']}, restarts {second.get('restarts')}")
    assert report[0]["_BOOT_ID"] == boot1, report[0]
    # the journal's files on the disk before the reset (journald syncs on its own only every 5 min)
    vm.run("journalctl", "--sync")
    vm.run("sync")

    # -- 2. the hog again; reset while the incident is open (SIGTERM sent, the engine tearing down)
    hog, size = start_hog(vm)
    avail2 = size + LINE - OVERSHOOT       # MemAvailable when the second hog started
    term2 = wait_for("the guard's SIGTERM of the restarted engine", lambda: guard_sigterm(vm, second["pid"]),
                     timeout=180)
    t_reset = time.time()
    vm.reset()
    assert vm.boot_id.replace("-", "") != boot1

    # -- 3. the next boot: the unclean-shutdown incident, the first report still there, the engine serving
    wait_for("the guard active", lambda: vm.run("systemctl", "is-active", UNIT, check=False).stdout.strip() == "active",
             timeout=180)
    unclean = wait_for("the unclean_shutdown entry", lambda: entries(vm, "unclean_shutdown", "-b"), timeout=120)
    listed = json.loads(vm.run(PY, "-m", "sparkguard", "incidents", "--json", timeout=60).stdout)
    mine = [i for i in listed if i.get("kind") == "unclean-shutdown"]
    assert mine, f"no unclean-shutdown incident in `sparkguard incidents`: {[i.get('kind') for i in listed]}"
    rec = json.loads(vm.run(PY, "-m", "sparkguard", "incidents", "--json", mine[0]["id"], timeout=60).stdout)
    table = vm.run(PY, "-m", "sparkguard", "incidents", timeout=60).stdout
    report_text = vm.run(PY, "-m", "sparkguard", "incidents", mine[0]["id"], timeout=60).stdout
    bb = rec["blackbox"]
    t_term2 = int(term2[0]["__REALTIME_TIMESTAMP"]) / 1e6
    print(f"[vm] reset {t_reset - t_term2:.1f} s after the second SIGTERM (guest's clock vs the host's); "
          f"black box: {bb['records']} records, gap {bb['gap_seconds']} s, lowest MemAvailable "
          f"{(bb['lowest']['mem_available_bytes'] or 0) >> 20} MiB; last (s after that SIGTERM, state, MiB): "
          f"{[(round(x['at'] - t_term2, 1), x['state'], x['mem_available_bytes'] >> 20) for x in bb['last']]}")
    assert rec["outcome"] == "hard_reset" and bb["cause"] == "hard_reset", rec
    assert bb["previous_boot_id"] == boot1, (bb, boot1)
    row = [ln for ln in table.splitlines() if ln.startswith(mine[0]["id"])]
    assert row and "unclean-shutdown" in row[0] and "hard_reset" in row[0], table
    assert "Black box" in report_text, report_text
    # the approach to the line reached the disk: the last record on it is at most APPROACH_LOST s
    # older than the SIGTERM (both the guest's CLOCK_REALTIME) and shows the hog's fill under way
    last = bb["last"][-1]
    assert t_term2 - last["at"] <= APPROACH_LOST, (t_term2, bb["last"])
    assert last["mem_available_bytes"] < avail2 - 2 * HOG_RATE, (avail2, bb["last"])
    assert unclean[0]["_BOOT_ID"] == vm.boot_id.replace("-", ""), unclean[0]
    # the first incident's report, read after the reset, from the previous boot's journal
    old = [e for e in entries(vm, "report") if e.get("_BOOT_ID") == boot1]
    assert old and old[0]["MESSAGE"] == report[0]["MESSAGE"], (old[:1], report[0]["MESSAGE"])
    third = ready_engine(vm, None, timeout=300)
    print(f"[vm] after the reset: engine {third['pid']} serving; unclean_shutdown: {unclean[0]['MESSAGE'][:160]}")

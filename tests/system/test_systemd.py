"""sparkguard under a real, booted systemd (issue 4): enable, notify, watchdog, reload, journald incidents.

Each test boots its own Debian bookworm machine with systemd-nspawn (``conftest.machine``) on an
overlay of a cached root, with sparkguard installed from a wheel of this checkout, its units put
in place by ``sparkguard install`` and the service enabled before boot.  Commands run inside with
nsenter.  The guard inside sees only the container's processes (its own PID namespace), so it can
never signal anything this test did not start; memory is the host's (same /proc/meminfo), so
thresholds are placed relative to the MemAvailable read inside, and the fake engine holds about
1.6 GiB at most.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from waiting import wait_for

from .conftest import CONFIG_PATH
from .nspawn import CAP_SYS_RESOURCE, VENV, has_capability

pytestmark = pytest.mark.system

GiB = 1024**3
MiB = 1024**2
UNIT = "sparkguard.service"
PY = f"{VENV}/bin/python"
#: memory each fake worker holds (two workers), and the headroom the line is placed with
WORKER_HOLD = 768 * MiB
LINE_MARGIN = 800 * MiB


def fmt(n: int) -> str:
    from sparkguard.units import format_size
    return format_size(n)


def config(term_below: str | int = "0.75GiB", tag: str = "none", grace: str = "2s") -> str:
    """A guard config whose targets match only this test's fake engine (model name ``sgtest-TAG``)."""
    return (f"guard:\n  term_below: {term_below}\n  grace: {grace}\n  poll_interval: 100ms\n"
            f"targets:\n  match: ['sgtest-{tag}']\n")


def mem_available_inside(c) -> int:
    """MemAvailable in bytes, read inside the container."""
    for line in c.run("cat", "/proc/meminfo").stdout.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in the container's /proc/meminfo")


def alive(c, pid: int) -> bool:
    """True if ``pid`` (container PID namespace) exists and is not a zombie."""
    r = c.run("cat", f"/proc/{pid}/stat", check=False)
    return r.returncode == 0 and r.stdout.rsplit(")", 1)[1].split()[0] != "Z"


def guard_journal(c) -> str:
    return c.journal_text("-b", "-u", UNIT)


def start_fake_engine(c, tag: str, *opts: str) -> dict:
    """Start the fake vLLM inside the container as user nobody, in a transient unit of its own.

    KillMode=process: systemd must not sweep the engine's cgroup when its top process dies, so
    whatever is gone afterwards was taken down by the guard (or by the engine itself).
    RemainAfterExit: the unit (and how its top process ended) stays to be inspected.  Running
    as another user makes the guard need CAP_KILL under its capability bounding set.
    The fake is not in the wheel: its files are copied inside (``Container.copy_fakes``).
    Returns ``{"unit", "model", "pids": [top, core, w0, w1]}`` once the tree is up.
    """
    script = c.copy_fakes()
    model = f"sgtest-{tag}"
    unit = f"fake-vllm-{tag}.service"
    ready = f"/tmp/fake-vllm-{tag}.ready"
    c.run("systemd-run", f"--unit={unit}", "--remain-after-exit", "-p", "KillMode=process", "-p", "User=nobody",
          "-p", "Environment=VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=1", "--",
          PY, script, "serve", model, "--tp", "2", "--hold", str(WORKER_HOLD), "--ready-file", ready, *opts)

    def ready_line():
        r = c.run("cat", ready, check=False)
        return r.returncode == 0 and r.stdout.strip()

    try:
        line = wait_for("the fake engine's ready file", ready_line, timeout=60)
    except AssertionError:
        raise AssertionError(f"fake engine did not come up:\n{c.journal_text('-u', unit)}") from None
    m = re.search(r"pids=([\d,]+)", line)
    assert m, f"unexpected ready line {line!r}"
    pids = [int(p) for p in m.group(1).split(",")]
    assert len(pids) == 4, f"expected top, EngineCore, 2 workers in {line!r}"
    return {"unit": unit, "model": model, "pids": pids}


def incident_reports(c) -> list[tuple[dict, dict]]:
    """(journal entry, incident record) for every report entry of the sparkguard unit.

    ``journalctl -u sparkguard MESSAGE_ID=<report id> -o json --all``; ``--all`` because -o json
    prints fields over 4096 bytes as null otherwise (journalctl(1)).
    """
    from sparkguard.journal import MESSAGE_IDS
    out = []
    for entry in c.journal("-u", UNIT, f"MESSAGE_ID={MESSAGE_IDS['report']}"):
        raw = entry.get("SPARKGUARD_REPORT")
        if isinstance(raw, list):  # binary-safe form: a list of byte values
            raw = bytes(raw).decode()
        assert isinstance(raw, str), f"report entry without SPARKGUARD_REPORT text: {entry}"
        out.append((entry, json.loads(raw)))
    return out


def guard_metrics(c) -> dict[str, float]:
    """The guard's /metrics inside the container (default 127.0.0.1:8799), as ``{name{labels}: value}``."""
    text = c.run(PY, "-c", "import urllib.request as u; "
                 "print(u.urlopen('http://127.0.0.1:8799/metrics', timeout=5).read().decode())").stdout
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def set_line_and_reload(c, tag: str, line: int) -> None:
    c.write(CONFIG_PATH, config(line, tag))
    c.run("systemctl", "reload", UNIT, timeout=15)


# ------------------------------------------------------------------------------------------------


def test_enabled_guard_starts_at_boot_and_is_active_only_after_ready(machine):
    c = machine(config=config())
    assert c.run("systemctl", "is-enabled", UNIT).stdout.strip() == "enabled"
    # We never started it: it is up because the boot transaction pulled it in.
    p = c.show(UNIT, "ActiveState", "SubState", "StatusText", "Type", "NRestarts", "MainPID",
               "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic", "DropInPaths",
               "FragmentPath", "NotifyAccess")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running"), p
    assert p["Type"] == "notify" and p["NotifyAccess"] == "main", p
    assert p["DropInPaths"] == "", f"the production unit must run as installed: {p}"
    assert p["NRestarts"] == "0", p
    assert re.search(r"MemAvailable \d+\.\d\d GiB, SIGTERM line 0\.75 GiB; state ok", p["StatusText"]), p
    # Type=notify: "active" is entered when READY=1 arrives, after the process has started and
    # taken its first sample; a plain exec would be active at fork time.
    assert int(p["ActiveEnterTimestampMonotonic"]) > int(p["ExecMainStartTimestampMonotonic"]) > 0, p
    journal = guard_journal(c)
    assert "mlockall failed" not in journal, f"the unit denies mlockall:\n{journal}"
    assert "not starting" not in journal, journal
    pid = int(p["MainPID"])
    status = c.run("cat", f"/proc/{pid}/status").stdout
    assert int(re.search(r"^VmLck:\s+(\d+) kB", status, re.M).group(1)) > 0, status
    if has_capability(c.run("cat", "/proc/1/status").stdout, CAP_SYS_RESOURCE):
        assert int(c.run("cat", f"/proc/{pid}/oom_score_adj").stdout) < 0
    # else: this host's bounding set lacks CAP_SYS_RESOURCE (see nspawn.py): nobody in the
    # container, not even its systemd, may lower oom_score_adj, so there is nothing to check.

    # Watch a restart: there must be a moment when the process runs but the unit is not yet active.
    old = int(p["MainPID"])
    c.run("systemctl", "restart", "--no-block", UNIT)
    seen = []

    def sample():
        s = c.show(UNIT, "ActiveState", "SubState", "MainPID", "StatusText")
        seen.append((s["ActiveState"], s["SubState"], s["MainPID"]))
        return s if s["ActiveState"] == "active" and int(s["MainPID"]) not in (0, old) else None

    s = wait_for("the restarted guard to become active", sample, timeout=30, interval=0.01)
    assert any(a == "activating" and sub == "start" and int(pid) not in (0, old) for a, sub, pid in seen), \
        f"never saw the new process running before READY: {seen}"
    assert "SIGTERM line 0.75 GiB" in s["StatusText"], s


def test_watchdog_kills_and_restarts_a_stopped_guard(machine):
    c = machine(config=config(), dropins={"50-test-watchdog.conf": "[Service]\nWatchdogSec=2s\n"})
    p = c.show(UNIT, "WatchdogUSec", "MainPID", "NRestarts", "ActiveState")
    assert p["WatchdogUSec"] == "2s" and p["ActiveState"] == "active", p
    pid = int(p["MainPID"])
    # A healthy guard pings from its poll loop: 2.5 watchdog periods pass without a restart.
    time.sleep(5)
    p = c.show(UNIT, "MainPID", "NRestarts", "ActiveState")
    assert (int(p["MainPID"]), p["NRestarts"], p["ActiveState"]) == (pid, "0", "active"), \
        f"healthy guard was restarted:\n{guard_journal(c)}"

    c.run("kill", "-STOP", str(pid))
    s = wait_for("systemd to kill and restart the stopped guard",
                 lambda: (lambda s: s if int(s["NRestarts"]) >= 1 and s["ActiveState"] == "active"
                          and int(s["MainPID"]) not in (0, pid) else None)(
                     c.show(UNIT, "MainPID", "NRestarts", "ActiveState", "StatusText")),
                 timeout=30)
    assert not alive(c, pid), "the stopped guard is still there"
    journal = guard_journal(c)
    assert re.search(r"Watchdog timeout \(limit 2s\)", journal), journal
    assert "SIGTERM line 0.75 GiB" in s["StatusText"], s


def test_reload_applies_a_changed_config_and_keeps_the_old_one_when_broken(machine):
    c = machine(config=config("0.75GiB"))
    pid = c.show(UNIT, "MainPID")["MainPID"]

    c.write(CONFIG_PATH, config("512MiB"))
    t = time.monotonic()
    c.run("systemctl", "reload", UNIT, timeout=15)
    assert time.monotonic() - t < 10, "reload took too long"
    # ExecReload (sparkguard reload) returns once the new line is in force
    assert guard_metrics(c).get("sparkguard_term_below_bytes") == 512 * MiB
    s = wait_for("STATUS to show the new line",
                 lambda: (lambda s: s if "SIGTERM line 0.50 GiB" in s["StatusText"]
                          and s["SubState"] == "running" else None)(
                     c.show(UNIT, "StatusText", "SubState", "MainPID", "ActiveState")), timeout=10)
    assert (s["MainPID"], s["ActiveState"]) == (pid, "active"), s

    c.write(CONFIG_PATH, "guard:\n  term_below: lots\n")
    t = time.monotonic()
    r = c.run("systemctl", "reload", UNIT, timeout=15, check=False)
    assert time.monotonic() - t < 10, "reload took too long"
    assert r.returncode != 0, f"a refused config must fail the reload: {r}"
    refused = wait_for("the journal to carry the reload command's reason",
                       lambda: [ln for ln in guard_journal(c).splitlines() if "refused, running config kept" in ln],
                       timeout=10)
    assert any("guard.term_below" in ln and "lots" in ln for ln in refused), refused
    why = wait_for("the journal to say why the reload failed",
                   lambda: [ln for ln in guard_journal(c).splitlines() if "reload failed" in ln], timeout=10)
    assert any(CONFIG_PATH in ln and "guard.term_below" in ln and "lots" in ln for ln in why), why
    s = wait_for("the unit to be back to running",
                 lambda: (lambda s: s if s["SubState"] == "running" else None)(
                     c.show(UNIT, "StatusText", "SubState", "MainPID", "ActiveState")), timeout=10)
    assert (s["MainPID"], s["ActiveState"]) == (pid, "active"), s
    assert "lots" not in s["StatusText"].split("kept")[0]
    # The old config is still the one in force: the metrics endpoint (default 127.0.0.1:8799; the
    # container has its own network namespace) still shows the 512 MiB line and one failed reload.
    values = guard_metrics(c)
    metrics = values
    assert values.get("sparkguard_term_below_bytes") == 512 * MiB, metrics
    assert values.get('sparkguard_config_reloads_total{result="failed"}') == 1, metrics
    assert values.get('sparkguard_config_reloads_total{result="ok"}') == 1, metrics


def _incident(machine, mode_opts: tuple[str, ...]):
    """Boot, start the fake engine, put the line above MemAvailable, wait until the tree is gone
    and the report is in the journal.  Returns (container, engine, record, entry, line)."""
    tag = uuid.uuid4().hex[:10]
    c = machine(config=config("0.75GiB", tag))
    assert c.show(UNIT, "DropInPaths")["DropInPaths"] == "", "must run the production unit as installed"
    engine = start_fake_engine(c, tag, *mode_opts)
    # The engine holds ~1.6 GiB; a line LINE_MARGIN above what is available now is crossed at
    # once, and once the engine's memory comes back MemAvailable is ~0.8 GiB above it again.  On
    # Linux >= 6.7 most of a dead process's pages first wait on the kernel's per-CPU free lists,
    # outside MemAvailable, draining at ~8 MiB/s per CPU (sparkguard.pcp): the guard waits for
    # them past guard.recovery_wait, so the report can take a minute.
    line = mem_available_inside(c) + LINE_MARGIN
    set_line_and_reload(c, tag, line)
    wait_for("the engine tree to be gone", lambda: not any(alive(c, p) for p in engine["pids"]), timeout=30)

    def report():
        for entry, rec in incident_reports(c):
            if (rec.get("target") or {}).get("root_pid") == engine["pids"][0]:
                return entry, rec
        return None

    try:
        entry, rec = wait_for("the incident report in the journal", report, timeout=150, interval=0.3)
    except AssertionError as e:
        raise AssertionError(f"{e}\nguard journal:\n{guard_journal(c)}") from None
    return c, engine, rec, entry, line


def _check_report(c, engine, rec, entry, line):
    top, core, w0, w1 = engine["pids"]
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", rec["id"]), rec["id"]
    assert entry.get("SPARKGUARD_INCIDENT") == rec["id"], entry
    assert entry.get("_SYSTEMD_UNIT") == UNIT and entry.get("MESSAGE"), entry
    assert rec["kind"] == "memory" and rec["drill"] is False and rec["dry_run"] is False, rec
    # The boot id as the guard sees it, read in the guard's own mount namespace: nspawn gives the
    # container its own boot_id by a mount over /proc/sys/kernel/random/boot_id, and the unit's
    # ProtectKernelTunables= re-mounts /proc/sys without it, so inside the unit the kernel's (the
    # host's) id shows.  On a real machine there is one boot id and no difference.
    guard_pid = c.show(UNIT, "MainPID")["MainPID"]
    boot_id = c.run("nsenter", "-t", guard_pid, "-m", "cat", "/proc/sys/kernel/random/boot_id").stdout.strip()
    assert rec["boot_id"].replace("-", "") == boot_id.replace("-", ""), (rec["boot_id"], boot_id)
    assert rec["thresholds"]["term_below_bytes"] == line and rec["thresholds"]["grace_seconds"] == 2, rec
    assert rec["meminfo"]["MemAvailable"] < line, rec["meminfo"]
    assert rec["ended_at"] >= rec["started_at"], rec
    t = rec["target"]
    assert engine["model"] in t["title"], t
    cmdlines = {e["pid"]: e["cmdline"] for e in t["tree"]}
    assert set(engine["pids"]) <= set(cmdlines), (engine["pids"], cmdlines)
    assert engine["model"] in cmdlines[top], cmdlines
    assert cmdlines[core].startswith("VLLM::EngineCore"), cmdlines
    assert cmdlines[w0].startswith("VLLM::Worker_TP") and cmdlines[w1].startswith("VLLM::Worker_TP"), cmdlines
    events = [e["event"] for e in rec["timeline"]]
    assert events[:2] == ["crossed", "sigterm"], events
    # `sparkguard incidents` inside lists it and shows it.
    listing = c.run("sparkguard", "incidents").stdout
    assert rec["id"] in listing, listing
    shown = c.run("sparkguard", "incidents", rec["id"]).stdout
    assert rec["id"] in shown and str(top) in shown, shown
    # The JSON store is written under the unit's hardening (ProtectSystem=strict + StateDirectory).
    st = c.run("stat", "-c", "%a", f"/var/lib/sparkguard/incidents/{rec['id']}.json").stdout.strip()
    assert st == "640", st
    return events


def test_incident_sigterm_under_the_production_unit(machine):
    c, engine, rec, entry, line = _incident(machine, ("--exit-delay", "0.2"))
    events = _check_report(c, engine, rec, entry, line)
    assert events == ["crossed", "sigterm", "exited", "recovered"], rec["timeline"]
    assert rec["outcome"] == "terminated", rec["outcome"]
    from sparkguard.journal import report_priority
    assert entry["PRIORITY"] == str(report_priority("terminated")), entry
    # The engine's top exited by itself after SIGTERM (vLLM-like teardown): CLD_EXITED (1), status 0.
    u = c.show(engine["unit"], "ExecMainCode", "ExecMainStatus", "Result")
    assert (u["ExecMainCode"], u["ExecMainStatus"], u["Result"]) == ("1", "0", "success"), u
    term = [e for e in rec["timeline"] if e["event"] == "sigterm"][0]
    assert engine["pids"][0] in term["pids"], term


def test_incident_sigkill_after_grace_when_sigterm_is_ignored(machine):
    c, engine, rec, entry, line = _incident(machine, ("--mode", "ignore-term"))
    events = _check_report(c, engine, rec, entry, line)
    assert events == ["crossed", "sigterm", "sigkill", "exited", "recovered"], rec["timeline"]
    assert rec["outcome"] == "killed", rec["outcome"]
    from sparkguard.journal import report_priority
    assert entry["PRIORITY"] == str(report_priority("killed")), entry
    u = c.show(engine["unit"], "ExecMainCode", "ExecMainStatus", "Result")
    assert (u["ExecMainCode"], u["ExecMainStatus"], u["Result"]) == ("2", "9", "signal"), u  # CLD_KILLED
    tl = {e["event"]: e for e in rec["timeline"]}
    assert "sigkill" in tl, events
    assert tl["sigkill"]["t"] - tl["sigterm"]["t"] >= 2 - 0.05, rec["timeline"]  # the whole grace
    assert set(engine["pids"]) <= set(tl["sigkill"]["pids"]), tl["sigkill"]
    from sparkguard.journal import MESSAGE_IDS
    kills = c.journal("-u", UNIT, f"MESSAGE_ID={MESSAGE_IDS['sigkill']}")
    assert any(k.get("SPARKGUARD_INCIDENT") == rec["id"] for k in kills), kills


def test_stop_is_quick_and_leaves_the_engine_running(machine):
    tag = uuid.uuid4().hex[:10]
    c = machine(config=config("0.75GiB", tag))
    engine = start_fake_engine(c, tag)
    t = time.monotonic()
    c.run("systemctl", "stop", UNIT, timeout=30)
    took = time.monotonic() - t
    p = c.show(UNIT, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert took < 5, f"systemctl stop took {took:.1f}s:\n{guard_journal(c)}"
    assert p["ActiveState"] == "inactive" and p["Result"] == "success", p
    # It handled SIGTERM itself and exited 0 (CLD_EXITED), rather than dying of the signal.
    assert (p["ExecMainCode"], p["ExecMainStatus"]) == ("1", "0"), f"{p}\n{guard_journal(c)}"
    assert all(alive(c, pid) for pid in engine["pids"]), "stopping the guard took the engine down"


def test_a_supervised_engine_runs_in_a_cgroup_of_its_own_under_the_unit(machine):
    """The production unit (Delegate=yes, its own cgroup writable under ProtectControlGroups=yes):
    the daemon moves into <unit>/guard, the engine run into <unit>/engine-<run id>; a grandchild
    that double-forked and called setsid is in that cgroup, and `sparkguard engine stop` takes it
    down with the engine (SIGKILL of the cgroup after the grace) and removes the cgroup."""
    from test_cgroup import ESCAPER
    tag = uuid.uuid4().hex[:10]
    engine = {"command": [PY, "-c", ESCAPER.replace("MARK", f"sgtest-{tag}")], "drop_caches": False,
              "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "60s", "health_interval": "100ms"}
    c = machine(config=config("64MiB", tag, grace="1s") + "engine: " + json.dumps(engine) + "\n")
    p = c.show(UNIT, "ControlGroup", "MainPID", "Delegate")
    assert p["Delegate"] == "yes", p
    unit_cg = "/sys/fs/cgroup" + p["ControlGroup"]

    def cgroup2_of(pid) -> str:   # the 0:: line (the host's v1 hierarchies show up too, see nspawn.py)
        return next(ln for ln in c.run("cat", f"/proc/{pid}/cgroup").stdout.splitlines() if ln.startswith("0::"))
    assert cgroup2_of(p["MainPID"]) == f"0::{p['ControlGroup']}/guard"

    def escaped():
        m = re.search(r"escaped pid=(\d+)", guard_journal(c))
        return int(m.group(1)) if m else None
    pid = wait_for("the engine's escaped grandchild", escaped, timeout=60)
    status = c.run(PY, "-m", "sparkguard", "engine", "status").stdout
    m = re.search(r"tracking: cgroup (\S+)", status)
    assert m and m.group(1).startswith(unit_cg + "/engine-"), status
    cg = m.group(1)
    assert cgroup2_of(pid) == "0::" + cg[len("/sys/fs/cgroup"):]
    assert str(pid) in c.run("cat", f"{cg}/cgroup.procs").stdout.split()
    c.run(PY, "-m", "sparkguard", "engine", "stop", timeout=30)
    wait_for("the escaped grandchild to be gone", lambda: not alive(c, pid), timeout=30)
    wait_for("the run's cgroup to be removed", lambda: c.run("test", "-e", cg, check=False).returncode != 0,
             timeout=30)
    journal = guard_journal(c)
    assert re.search(r"sweep: 1 leftover processes of the engine: " + str(pid), journal), journal

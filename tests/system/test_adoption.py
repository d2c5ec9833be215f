"""The engine outlives a restart of sparkguard, under the production unit in a booted Debian 12 (systemd 252).

One boot: sparkguard supervises the fake vLLM (tests/fakes) as configured in
/etc/sparkguard/sparkguard.yaml; a client inside polls its /health every 50 ms throughout.

1. ``systemctl restart sparkguard``: the daemon asks systemd for its job (``restart``), keeps the
   engine, the new daemon adopts it; the time from the restart to the adopted engine ready (and
   the guard's READY=1) is measured inside the container and printed;
2. ``kill -9`` of the main pid, then a SIGSTOPped daemon aborted by the watchdog: systemd
   restarts the unit (``Restart=always``), ExecStopPost leaves the engine (no stop job) and arms the
   orphan check, the new daemon adopts it, and the check, once it fires, leaves it (no false stop);
3. ``systemctl stop sparkguard``: the engine is stopped with the daemon (``engine.on_daemon_stop: stop``);
4. a daemon killed by systemd inside its stop (TimeoutStopSec): ExecStopPost stops the engine's cgroup;
5. ``engine.on_daemon_stop: keep``: the stop leaves the engine, the next start adopts it; a stop
   (keep) right after a crash and its adoption is not undone by the crash's orphan check;
6. ``systemctl stop`` while the unit waits to restart after a crash (``RestartSec``) runs no
   ExecStopPost; the orphan check the crash's stop-post armed stops the engine once the wait is
   over (sparkguard/supervisor/orphancheck.py), and ``sparkguard engine status`` has nothing to
   warn about then;
7. a start queued while that check stops the engine waits for it (no daemon adopts an engine the
   check is stopping).

The client saw no failed request during 1 and 2.

"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from .conftest import CONFIG_PATH
from waiting import wait_for

from .test_systemd import PY, UNIT, alive, config, guard_journal

pytestmark = pytest.mark.system

PORT = 8011
RESTARTS = 3     #: restarts timed in a row

#: run inside: poll URL every 50 ms, write {"ok", "fail", "errors"} to OUT after each request
POLLER = r'''
import json, os, sys, time, urllib.request
url, out = sys.argv[1], sys.argv[2]
ok, fail, errors = 0, 0, []
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
while True:
    try:
        with opener.open(url, timeout=2) as r:
            ok += r.status == 200
            if r.status != 200:
                fail += 1; errors.append(f"status {r.status}")
    except OSError as e:
        fail += 1; errors.append(f"{time.time():.3f} {e}")
    with open(out + ".tmp", "w") as f:
        json.dump({"ok": ok, "fail": fail, "errors": errors[-20:]}, f)
    os.replace(out + ".tmp", out)
    time.sleep(0.05)
'''

#: run inside: `systemctl restart sparkguard`, then ask the control socket every 10 ms until the
#: engine pid ARGV[1] is adopted and ready; prints {"restart_returned", "adopted_ready"} seconds
MEASURE = r'''
import json, subprocess, sys, time
from sparkguard import control
pid = int(sys.argv[1])
t0 = time.monotonic()
subprocess.run(["systemctl", "restart", "sparkguard.service"], check=True, timeout=60)
t1 = time.monotonic()
while time.monotonic() - t0 < 30:
    try:
        st = control.request("/run/sparkguard/control.sock", {"op": "status"}, timeout=2)["status"]
    except (OSError, ValueError, KeyError):
        time.sleep(0.01); continue
    if st.get("adopted") and st["pid"] == pid and st["state"] == "ready":
        print(json.dumps({"restart_returned": t1 - t0, "adopted_ready": time.monotonic() - t0}))
        sys.exit(0)
    time.sleep(0.01)
print(json.dumps({"restart_returned": t1 - t0, "adopted_ready": None, "status": st}))
sys.exit(1)
'''


def engine_status(c) -> dict:
    r = c.run(PY, "-m", "sparkguard", "engine", "status", "--json", check=False, timeout=30)
    try:
        return json.loads(r.stdout).get("status") or {}
    except ValueError:
        return {}


def unguarded(c) -> list[float]:
    """Seconds between each "stopping (signal)" of the unit's journal and the next daemon's
    "started: SIGTERM below" line (journal monotonic times): while no guard polls."""
    out, t_stop = [], None
    for ln in c.journal_text("-b", "-u", UNIT, "-o", "short-monotonic").splitlines():
        m = re.match(r"\[\s*([\d.]+)\]", ln)
        if not m:
            continue
        if "stopping (signal)" in ln:
            t_stop = float(m.group(1))
        elif "started: SIGTERM below" in ln and t_stop is not None:
            out.append(float(m.group(1)) - t_stop)
            t_stop = None
    return out


def check_verdict(c, invocation: str, timeout: float = 60) -> str:
    """The verdict line of the orphan check armed at the crash of ``invocation``, once it has run
    (the check's journal line in the unit's journal)."""
    mark = f"orphan-check: invocation {invocation}, check "

    def final():
        lines = [ln for ln in guard_journal(c).splitlines() if mark in ln and ": again: " not in ln]
        return lines[-1] if lines else None
    return wait_for(f"the orphan check of invocation {invocation}", final, timeout=timeout, interval=0.3)


def crash(c) -> str:
    """``kill -9`` of the unit's main pid; returns the crashed invocation's id."""
    p = c.show(UNIT, "MainPID", "InvocationID")
    c.run("kill", "-9", p["MainPID"])
    return p["InvocationID"]


def adopted(c, pid: int, timeout: float = 30) -> dict:
    return wait_for(f"pid {pid} adopted and ready",
                    lambda: (lambda st: st if st.get("adopted") and st.get("pid") == pid and st.get("state") == "ready"
                             else None)(engine_status(c)), timeout=timeout, interval=0.2)


def test_restart_and_crash_keep_the_engine_serving_and_stop_stops_it(machine):
    tag = uuid.uuid4().hex[:10]
    c = machine(config=config("64MiB", tag, grace="2s"))
    cmd = [PY, c.copy_fakes(), "serve", f"sgtest-{tag}", "--tp", "2", "--port", str(PORT)]
    engine = {"command": cmd, "health_url": f"http://127.0.0.1:{PORT}/health", "drop_caches": False,
              "start_above": "64MiB", "stable_for": "0s", "quiesce_timeout": "60s", "health_interval": "200ms"}
    c.write(CONFIG_PATH, config("64MiB", tag, grace="2s") + "engine: " + json.dumps(engine) + "\n")
    c.run("systemctl", "restart", UNIT, timeout=60)      # no engine yet: a plain restart
    st = wait_for("the engine ready", lambda: (lambda s: s if s.get("state") == "ready" else None)(engine_status(c)),
                  timeout=60, interval=0.3)
    pid = st["pid"]
    assert st["tracking"]["mode"] == "cgroup", st["tracking"]
    c.write("/opt/sparkguard-tests/poller.py", POLLER)
    c.write("/opt/sparkguard-tests/measure.py", MEASURE)
    c.run("systemd-run", "--unit=sg-poller", "--", PY, "/opt/sparkguard-tests/poller.py", f"http://127.0.0.1:{PORT}/health",
          "/var/tmp/poll.json")
    wait_for("the poller's first answers", lambda: c.run("cat", "/var/tmp/poll.json", check=False).returncode == 0,
             timeout=20)

    # 1. systemctl restart (RESTARTS times): kept, adopted; timed inside the container
    for n in range(RESTARTS):
        r = c.run(PY, "/opt/sparkguard-tests/measure.py", str(pid), timeout=90, check=False)
        assert r.returncode == 0, f"{r.stdout}\n{guard_journal(c)}"
        fig = json.loads(r.stdout)
        print(f"[adoption] restart {n + 1}: systemctl restart returned after {fig['restart_returned']:.3f} s, "
              f"engine adopted and ready after {fig['adopted_ready']:.3f} s")
    print("[adoption] no guard polling (old loop's 'stopping (signal)' -> new daemon's 'started:'), s: "
          + ", ".join(f"{w:.3f}" for w in unguarded(c)))
    journal = guard_journal(c)
    steps = [ln for ln in c.journal_text("-b", "-u", UNIT, "-o", "short-monotonic").splitlines()
             if re.search(r"Found left-over|stopping \(signal\)|keeping the engine|stop-post|Stopped|Starting|Started|"
                          r"engine control on|adoption adopted|\(adopted\) answers|stopped$", ln)]
    print("[adoption] the restart in the unit's journal:\n  " + "\n  ".join(steps[-12:]))
    assert re.search(r"keeping the engine running: systemd is restarting the unit", journal), journal
    assert "adoption adopted: pid %d" % pid in journal, journal
    assert alive(c, pid)

    # 2. kill -9 of the daemon: restarted by systemd, ExecStopPost leaves the engine (and arms the
    #    orphan check), adopted again; the check, once it has run, has left the adopted engine alone
    main = int(c.show(UNIT, "MainPID")["MainPID"])
    inv = crash(c)
    wait_for("a new main pid", lambda: int(c.show(UNIT, "MainPID")["MainPID"]) not in (0, main), timeout=30)
    adopted(c, pid)
    journal = guard_journal(c)
    assert re.search(r"stop-post: no stop job \(service result signal\): left for the next daemon to adopt; "
                     r"orphan check 1 armed", journal), journal
    verdict = check_verdict(c, inv)
    print(f"[adoption] the orphan check after a crash and its restart: {verdict}")
    assert ": leave: the unit was started again since" in verdict, verdict
    st = engine_status(c)
    assert st.get("adopted") and st.get("pid") == pid and st.get("state") == "ready", st

    # 2b. a wedged daemon (SIGSTOP): the unit's watchdog (WatchdogSec=5s) aborts it, systemd
    #     restarts it, the engine is adopted again
    main = int(c.show(UNIT, "MainPID")["MainPID"])
    c.run("kill", "-STOP", str(main))
    wait_for("the watchdog's restart", lambda: int(c.show(UNIT, "MainPID")["MainPID"]) not in (0, main), timeout=40)
    adopted(c, pid)
    journal = guard_journal(c)
    assert re.search(r"Watchdog timeout", journal) and re.search(
        r"stop-post: no stop job \(service result watchdog\): left for the next daemon", journal), journal
    poll = json.loads(c.run("cat", "/var/tmp/poll.json").stdout)
    assert poll["fail"] == 0 and poll["ok"] > 20, poll

    # 3. systemctl stop: the engine goes with the daemon
    c.run("systemctl", "stop", UNIT, timeout=60)
    wait_for("the engine to be gone", lambda: not alive(c, pid), timeout=30)
    journal = guard_journal(c)
    assert re.search(r"stopping the engine: systemd is stopping the unit", journal), journal
    c.run("systemctl", "stop", "sg-poller", check=False)

    # 4. a daemon still inside its stop when TimeoutStopSec runs out (an engine that ignores
    #    SIGTERM, a grace longer than the timeout): systemd SIGKILLs the daemon, and ExecStopPost
    #    (a stop job, no handover note) stops the engine's cgroup.  (SIGSTOP cannot stand in for a
    #    hang: systemd sends SIGCONT after the SIGTERM, systemd.kill(5).)
    c.write("/etc/systemd/system/sparkguard.service.d/50-test-timeout.conf", "[Service]\nTimeoutStopSec=8s\n")
    c.run("systemctl", "daemon-reload")
    engine["command"] = cmd + ["--mode", "ignore-term"]
    c.write(CONFIG_PATH, config("64MiB", tag, grace="20s") + "engine: " + json.dumps(engine) + "\n")
    c.run("systemctl", "start", UNIT, timeout=60)
    st = wait_for("a new engine ready", lambda: (lambda s: s if s.get("state") == "ready" else None)(engine_status(c)),
                  timeout=60, interval=0.3)
    pid, cg = st["pid"], st["tracking"]["cgroup"]
    c.run("systemctl", "stop", UNIT, timeout=60)
    wait_for("the engine of the killed daemon to be gone", lambda: not alive(c, pid), timeout=30)
    p = c.show(UNIT, "Result", "ActiveState")
    assert p["Result"] == "timeout", f"{p}\n{guard_journal(c)}"
    journal = guard_journal(c)
    assert re.search(r"stop-post: a stop job and no handover note: the engine goes with the daemon; stopped "
                     + re.escape(cg), journal), journal
    assert c.run("test", "-e", cg, check=False).returncode != 0, f"{cg} was not removed"

    # 5. engine.on_daemon_stop: keep: `systemctl stop` leaves the engine running (unguarded), the
    #    runtime directory (and the FIFOs' paths) is removed by systemd; the next start adopts it
    #    and re-attaches its output through /proc/PID/fd
    engine["command"], engine["on_daemon_stop"] = cmd, "keep"
    c.write(CONFIG_PATH, config("64MiB", tag, grace="2s") + "engine: " + json.dumps(engine) + "\n")
    c.run("systemctl", "start", UNIT, timeout=60)
    st = wait_for("a new engine ready", lambda: (lambda s: s if s.get("state") == "ready" else None)(engine_status(c)),
                  timeout=60, interval=0.3)
    pid = st["pid"]
    inv = crash(c)          # the crash arms an orphan check; the stop (keep) after the adoption is not undone
    adopted(c, pid)
    c.run("systemctl", "stop", UNIT, timeout=60)
    assert alive(c, pid), guard_journal(c)
    verdict = check_verdict(c, inv)
    print(f"[adoption] the orphan check after a crash, its adoption and a stop (keep): {verdict}")
    assert ": leave: " in verdict and alive(c, pid), verdict
    assert c.run("test", "-e", "/run/sparkguard", check=False).returncode != 0, "RuntimeDirectory kept on stop?"
    c.run("systemctl", "start", UNIT, timeout=60)
    st = adopted(c, pid)
    assert "could not be re-attached" not in st["adoption"]["detail"], st["adoption"]
    journal = guard_journal(c)
    assert re.search(r"keeping the engine running: systemd is stopping the unit \(engine.on_daemon_stop: keep\)",
                     journal), journal
    assert "engine: handover: pid %d kept running" % pid in journal, journal

    # 6. a stop during the restart wait after a crash (RestartSec, widened to 5 s here so the
    #    stop lands in it): systemd 252 goes to inactive without ExecStopPost; the orphan check
    #    armed at the crash stops the engine once the wait is over
    engine["on_daemon_stop"] = "stop"
    c.write(CONFIG_PATH, config("64MiB", tag, grace="2s") + "engine: " + json.dumps(engine) + "\n")
    c.write("/etc/systemd/system/sparkguard.service.d/60-test-restartsec.conf", "[Service]\nRestartSec=5s\n")
    c.run("systemctl", "daemon-reload")
    c.run("systemctl", "restart", UNIT, timeout=60)     # adopts the engine kept in step 5 (same command)
    st = adopted(c, pid)
    cg = st["tracking"]["cgroup"]
    t_crash = time.monotonic()
    inv = crash(c)
    wait_for("the restart wait", lambda: c.show(UNIT, "SubState")["SubState"] == "auto-restart", timeout=20,
             interval=0.05)
    c.run("systemctl", "stop", UNIT, timeout=60)
    p = c.show(UNIT, "ActiveState", "InvocationID")
    assert p["ActiveState"] in ("inactive", "failed") and p["InvocationID"] == inv, p
    assert alive(c, pid), "stopped by the stop itself: no gap to close?"
    verdict = check_verdict(c, inv)
    print(f"[adoption] stop during the restart wait: {verdict}")
    assert ": stop: the unit is inactive after the crash and was not started again" in verdict and cg in verdict, verdict
    wait_for("the engine to be gone", lambda: not alive(c, pid), timeout=30)
    print(f"[adoption] stop during the restart wait: the engine gone {time.monotonic() - t_crash:.1f} s after the "
          "crash (RestartSec 5 s + 3 s, then SIGTERM)")
    assert c.run("test", "-e", cg, check=False).returncode != 0, f"{cg} was not removed"
    r = c.run(PY, "-m", "sparkguard", "engine", "status", check=False, timeout=30)
    assert r.returncode == 3 and "holds processes" not in r.stderr, r.stderr

    # 7. a start queued while the check stops the engine waits for it (the check's service is
    #    ordered Before= the unit): an engine that ignores SIGTERM and a 4 s grace hold the check
    #    in its stop; `systemctl start --no-block` meanwhile is a waiting job, and the daemon it
    #    starts finds the old engine gone (nothing to adopt) and starts a new one
    engine["command"] = cmd + ["--mode", "ignore-term"]
    c.write(CONFIG_PATH, config("64MiB", tag, grace="4s") + "engine: " + json.dumps(engine) + "\n")
    c.run("systemctl", "start", UNIT, timeout=60)
    st = wait_for("a new engine ready", lambda: (lambda s: s if s.get("state") == "ready" else None)(engine_status(c)),
                  timeout=60, interval=0.3)
    pid = st["pid"]
    inv = crash(c)
    wait_for("the restart wait", lambda: c.show(UNIT, "SubState")["SubState"] == "auto-restart", timeout=20,
             interval=0.05)
    c.run("systemctl", "stop", UNIT, timeout=60)
    check = f"sparkguard-orphan-check-{inv}-1.service"
    wait_for("the check stopping the engine (its sweep's first line)",
             lambda: re.search(r"orphan-check: \d+ leftover processes of the engine", c.journal_text("-b", "-u", check)),
             timeout=30, interval=0.1)
    r = c.sh(f"systemctl start --no-block {UNIT}; systemctl list-jobs --no-legend --plain --full; "
             f"systemctl show -p ActiveState --value {check}")
    jobs, running = r.stdout.strip().rsplit("\n", 1)
    print(f"[adoption] a start queued while the check stops the engine (check {running}): jobs {jobs!r}")
    if running == "activating":      # the check ran on past list-jobs: the start must have been waiting for it
        assert re.search(rf"{re.escape(UNIT)}\s+start\s+waiting", jobs), jobs
    st = wait_for("the next daemon's engine ready", lambda: (lambda s: s if s.get("state") == "ready" else None)(
        engine_status(c)), timeout=90, interval=0.3)
    assert st["pid"] != pid and not alive(c, pid), st
    assert ": stop: " in check_verdict(c, inv)
    assert st.get("adoption", {}).get("result") in (None, "gone"), st.get("adoption")
    c.run("systemctl", "stop", UNIT, timeout=60)
    left = c.run("systemctl", "list-units", "--all", "--plain", "--no-legend", "sparkguard-orphan-check-*").stdout
    assert left.strip() == "", f"orphan check units left loaded:\n{left}"

"""sd_notify protocol of ``sparkguard run`` against a NOTIFY_SOCKET bound by the test; reload; stop."""

import signal

from guardrun import GuardProc, unique


def test_ready_status_watchdog_reload_stopping():
    name = unique()
    g = GuardProc({"guard": {"term_below": "0.6GiB"}, "targets": {"match": [f"^{name}$"]}},
                  watchdog_usec=400_000)
    try:
        ready = g.wait_ready()
        assert "SIGTERM line 0.60 GiB" in ready.get("STATUS", ""), ready
        assert "MemAvailable 0 B" not in ready["STATUS"]
        assert "state ok" in ready["STATUS"]
        # WATCHDOG=1 comes from the poll loop, every half of WATCHDOG_USEC
        g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)
        g.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=5)

        # reload with a changed line: RELOADING=1 + MONOTONIC_USEC, then READY=1, STATUS has the new line
        g.write_config({**g.cfg, "guard": {"term_below": "0.7GiB"}})
        g.proc.send_signal(signal.SIGHUP)
        rel = g.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=10)
        assert int(rel["MONOTONIC_USEC"]) > 0
        g.notify.wait_for(lambda m: m.get("READY") == "1", timeout=10)
        g.notify.wait_for(lambda m: "SIGTERM line 0.70 GiB" in m.get("STATUS", ""), timeout=10)

        # a broken file on reload keeps the running config and says why
        with open(g.config_path, "w") as f:
            f.write("guard:\n  grace: soon\n")
        g.proc.send_signal(signal.SIGHUP)
        g.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout=10)
        g.notify.wait_for(lambda m: m.get("READY") == "1", timeout=10)
        bad = g.notify.wait_for(lambda m: "reload FAILED" in m.get("STATUS", ""), timeout=10)
        assert "guard.grace" in bad["STATUS"] and "soon" in bad["STATUS"]
        assert g.proc.poll() is None
        g.wait_log("reload failed, keeping the running config")

        g.proc.send_signal(signal.SIGTERM)
        g.notify.wait_for(lambda m: m.get("STOPPING") == "1", timeout=10)
        assert g.proc.wait(10) == 0
    finally:
        g.stop()


def test_no_watchdog_pings_when_watchdog_pid_is_another_process():
    """sd_watchdog_enabled(3): WATCHDOG_PID names the process meant to ping; not us => no pings."""
    name = unique()
    g = GuardProc({"targets": {"match": [f"^{name}$"]}}, watchdog_usec=100_000, env_extra={"WATCHDOG_PID": "1"})
    try:
        g.wait_ready()
        # absence cannot be awaited: watch 1 s, ten times the would-be ping interval
        import time
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            g.notify.recv(max(0.01, end - time.monotonic()))
    finally:
        g.stop()
    assert not [m for m in g.notify.messages if m.get("WATCHDOG") == "1"]

#!/usr/bin/env python3
"""The failure itself, in the test VM and without a guard: a fast multi-process hog against a heartbeat.

Run as root from the repository root (not part of the test suite; about 5 minutes under TCG with
the image of tests/vm/ cached, 2 more to build it)::

    python3 bench/vm_oom.py                          # 4 hog processes, 90 s at most
    python3 bench/vm_oom.py --procs 8 --seconds 120

One QEMU guest (tests/vm/qemu.py: Debian 12, its kernel, 2 GiB, TCG unless
SPARKGUARD_TEST_VM_ACCEL=kvm) gets sparkguard's wheel and ``sparkguard install``, then the seed's
host tuning live without a reboot and without the guard: ``modprobe zram`` (Debian's kernel does not
load it), ``sparkguard install-zram --boot`` (6 GiB lz4 zram at priority 100) and ``sparkguard tune
--boot`` (swappiness 180, watermark_scale_factor 100, page-cluster 0).  Then, inside:

* a heartbeat (plain python3, nice 0) that sleeps 10 ms, stamps CLOCK_MONOTONIC into a file and
  keeps its own worst gap between two stamps;
* ``--procs`` hog processes that each append 16 MiB chunks of page-incompressible data (a random
  1 MiB block repeated: every 4 KiB page is random to zram's per-page lz4) as fast as they can,
  until the kernel kills them or ``--seconds`` pass.

Meanwhile the host sends ``true`` to the guest's agent every second and times the answer (is the
machine still answering?).  Printed at the end, as JSON: the heartbeat's worst stall (worst gap less
the 10 ms sleep), the agent's worst and median round trip and how many calls got no answer within
35 s, the kernel's OOM kills (``/proc/vmstat`` oom_kill delta, and the "Killed process" lines of
dmesg: who), the hogs' exit statuses, the seconds until the first OOM kill, and the VM's facts
(memory, CPUs, kernel, accel).

Later sessions: the same hog with sparkguard, earlyoom and nohang side by side (issue 19).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from system import nspawn  # noqa: E402
from vm import image, qemu  # noqa: E402

HEARTBEAT = r"""
import os, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
end = time.monotonic() + seconds
last = time.monotonic(); worst = 0.0; n = 0
while last < end:
    time.sleep(0.01)
    now = time.monotonic()
    worst = max(worst, now - last); last = now; n += 1
    os.pwrite(fd, f"{now:.6f} {worst:.6f} {n}\n".ljust(64).encode(), 0)
"""

HOG = r"""
import os, sys
block = os.urandom(1 << 20)
held = []
while True:
    held.append(bytearray(block * 16))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4, help="hog processes (default 4)")
    ap.add_argument("--seconds", type=float, default=90, help="longest run of the hog (default 90)")
    ap.add_argument("--recover", type=float, default=240,
                    help="seconds to wait for a guest that stopped answering (default 240)")
    args = ap.parse_args()
    reason = qemu.unavailable_reason()
    if reason:
        print(f"vm_oom: cannot run here: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds through the finally below, which powers the guest off and ends QEMU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    qemu.reap_stale()
    img = image.cached_image(log=lambda m: print(f"[vm_oom] {m}", file=sys.stderr, flush=True))
    wheel = nspawn.build_wheel(Path(tempfile.mkdtemp(prefix="vm_oom-")))
    vm = qemu.VM(img)
    try:
        vm.start()
        print(f"[vm_oom] booted in {vm.boot_seconds[-1]} s", file=sys.stderr, flush=True)
        vm.put(f"/var/tmp/{wheel.name}", wheel.read_bytes())
        vm.run(f"{nspawn.VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps", f"/var/tmp/{wheel.name}",
               timeout=300)
        vm.run(f"{nspawn.VENV}/bin/sparkguard", "install", timeout=300)
        vm.run("modprobe", "zram")
        vm.run("sparkguard", "install-zram", "--boot", timeout=300)
        vm.run("sparkguard", "tune", "--boot", timeout=300)
        vm.put("/var/tmp/heartbeat.py", HEARTBEAT.encode())
        vm.put("/var/tmp/hog.py", HOG.encode())
        facts = {"memory_mib": vm.memory_mib, "cpus": vm.cpus, "accel": vm.accel,
                 "kernel": vm.run("uname", "-r").stdout.strip(),
                 "swaps": vm.run("cat", "/proc/swaps").stdout.splitlines()[1:],
                 "sysctls": {k: vm.run("sysctl", "-n", k).stdout.strip()
                             for k in ("vm.swappiness", "vm.watermark_scale_factor", "vm.page-cluster")}}
        oom_before = int(vm.sh("awk '$1==\"oom_kill\"{print $2}' /proc/vmstat").stdout)
        hog_script = ("python3 /var/tmp/heartbeat.py /var/tmp/hb %s & hb=$!; sleep 1; "
                      "echo start $(cut -d' ' -f1 /proc/uptime); "
                      "for i in $(seq %d); do python3 /var/tmp/hog.py & done; "
                      "for j in $(jobs -p); do [ $j = $hb ] || { wait $j; echo hog $j $?; }; done; "
                      "wait $hb") % (args.seconds + 5, args.procs)
        rtts: list[float] = []
        lost = [0]
        stop = threading.Event()

        def ping() -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    # rc -9: `true` itself took over 5 s inside; the round trip still counts
                    vm.run("true", timeout=5, check=False)
                    rtts.append(time.monotonic() - t)
                except TimeoutError:
                    lost[0] += 1
                stop.wait(max(0.0, 1.0 - (time.monotonic() - t)))

        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        t0 = time.monotonic()
        try:
            r = vm.sh(hog_script, check=False, timeout=args.seconds)
        except TimeoutError:
            r = None  # the agent could not even kill the hog and answer: the guest stopped answering
        wall = time.monotonic() - t0
        stop.set()
        pinger.join(timeout=60)
        recovered = None  # seconds after the hog's end until the agent answered again
        while r is None and time.monotonic() - t0 < args.seconds + 30 + args.recover:
            try:
                if vm.run("true", timeout=5, check=False).returncode == 0:
                    recovered = round(time.monotonic() - t0 - wall, 1)
                    break
            except TimeoutError:
                continue
        console_kills = [ln for ln in vm.console(100000).splitlines() if "Killed process" in ln]
        if r is None and recovered is None:
            print(json.dumps({"vm": facts, "procs": args.procs, "answered": False,
                              "agent_calls_unanswered": lost[0], "console_oom_kills": console_kills,
                              "console_tail": vm.console(20)}, indent=1))
            return 1
        hb = vm.run("cat", "/var/tmp/hb", check=False).stdout.split()
        oom_after = int(vm.sh("awk '$1==\"oom_kill\"{print $2}' /proc/vmstat").stdout)
        killed = [ln for ln in vm.run("dmesg", check=False).stdout.splitlines() if "Killed process" in ln]
        out = r.stdout if r is not None else ""
        start = next((float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("start ")), None)
        first_kill = None
        if killed and start is not None:
            first_kill = round(float(killed[0].split("]", 1)[0].strip("[ ")) - start, 1)
        result = {
            "vm": facts, "procs": args.procs, "wall_s": round(wall, 1),
            "hog_run": "unanswered" if r is None else ("timed out" if r.timed_out else "ended"),
            "agent_back_after_s": recovered, "console_oom_kills": console_kills,
            "heartbeat_worst_stall_s": round(float(hb[1]) - 0.01, 3) if len(hb) >= 2 else None,
            "heartbeat_beats": int(hb[2]) if len(hb) >= 3 else None,
            "agent_rtt_worst_s": round(max(rtts), 3) if rtts else None,
            "agent_rtt_median_s": round(statistics.median(rtts), 3) if rtts else None,
            "agent_calls_unanswered": lost[0],
            "oom_kills": oom_after - oom_before, "oom_killed": killed, "first_oom_kill_s": first_kill,
            "hog_exits": [ln for ln in out.splitlines() if ln.startswith("hog ")],
        }
        print(json.dumps(result, indent=1))
        return 0
    finally:
        vm.close()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The failure and the head-to-head in the test VM: one multi-process hog against a heartbeat, per guard.

Run as root from the repository root (not part of the test suite; about 15 minutes under TCG with
the image of tests/vm/ cached, 2 more to build it)::

    python3 bench/vm_oom.py                                   # idle, busy, sparkguard, earlyoom, nohang, none
    python3 bench/vm_oom.py --procs 2 --guards idle,none --out bench/results/vm-oom.txt

One QEMU guest (tests/vm/qemu.py: Debian 12, its kernel, 2 GiB, 2 vCPUs, TCG unless
SPARKGUARD_TEST_VM_ACCEL=kvm) gets sparkguard's wheel and ``sparkguard install``, then the seed's
host tuning through the installed ``sparkguard-setup.service`` (the zram module, a 6 GiB lz4 zram
swap at priority 100, swappiness 180, watermark_scale_factor 100, page-cluster 0), and Debian 12's
earlyoom and nohang packages from the host's apt cache (``dpkg -i``; tests/install-deps has put
them there), kept from starting by a policy-rc.d.  Then, per entry of ``--guards``, in this order
and in the same boot (the state before each run, MemAvailable and swap in use, is in its row):

* ``idle``: the heartbeat alone for ``--idle-seconds``: the baseline of its worst stall;
* ``busy``: as many busy loops as hog workers for ``--idle-seconds``, no memory: what the CPU's
  share alone costs the heartbeat on 2 vCPUs;
* ``sparkguard``, ``earlyoom``, ``nohang``: that guard's own Debian/installed unit started with
  ``systemctl start`` (sparkguard's with its Nice=-20, mlock and OOMScoreAdjust=-1000), the hog
  run, the unit stopped;
* ``short``: no guard, the same hog's workers stopping once MemAvailable is 256 MiB above the line
  (what the fill itself costs the heartbeat, without a guard's CPU);
* ``none``: the hog with no guard (last: the kernel OOM killer may take daemons with it).

The guards' lines, the same for all three: SIGTERM below :data:`TERM_BELOW` of MemAvailable (the
sparkguard default), SIGKILL below :data:`KILL_BELOW` (earlyoom's and nohang's second line;
sparkguard SIGKILLs after its 5 s grace), the hog preferred by its command line (sparkguard
``targets.match``, earlyoom ``--prefer``, nohang ``@BADNESS_ADJ_RE_CMDLINE``).  earlyoom and
nohang act only when swap is low too; with a 6 GiB zram on a 2 GiB machine SwapFree never gets
low, so both get a swap line of 100 % (bench/headtohead.py does the same) and act on memory alone.

The hog (``/var/tmp/sg-hog.py PROCS``) is one tree, as an inference engine is: a top process that
forks ``--procs`` workers, each appending 16 MiB chunks of page-incompressible data (a random 1 MiB
block repeated: every 4 KiB page is random to zram's per-page lz4) as fast as it can; on SIGTERM
the top forwards SIGTERM to its workers (as vLLM's API server does to its engine).  It ends when
every worker is gone or after ``--seconds``.  The heartbeat (plain python3, nice 0) sleeps 10 ms,
stamps CLOCK_MONOTONIC and keeps its worst gap; every 0.25 s it also appends MemAvailable and the
swap in use to a series (the fill rate).  Meanwhile the host sends ``true`` to the guest's agent
every second and times the answer (does the machine still answer?).

Per run: the heartbeat's worst stall (worst gap less the 10 ms sleep), the agent's worst round trip
and calls unanswered within 35 s, the fill rate (memory in use, RAM + swap, over the hog's first
2 s), seconds from the hog's start to the guard's first SIGTERM (its journal line), the kernel's
OOM kills (/proc/vmstat oom_kill delta) and who they took (dmesg "Killed process" lines), the hog's
workers' exit statuses.  Printed as JSON per run and as a table; ``--out FILE`` writes the command,
the VM's facts and the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
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

sys.path.insert(0, str(ROOT / "bench"))
import headtohead  # noqa: E402

MiB = 1 << 20
#: sparkguard's default guard.term_below (README, "Configuration"), used by all three guards
TERM_BELOW = 768 * MiB
#: earlyoom's and nohang's SIGKILL line: half the TERM line (earlyoom's own default ratio, -m 10,5)
KILL_BELOW = 384 * MiB
TAG = "sg-hog"
GUARDS = ("idle", "busy", "short", "sparkguard", "earlyoom", "nohang", "none")
#: Debian 12's packages, from the host's apt cache (tests/install-deps installs them on the host)
DEBS = ("earlyoom_*_amd64.deb", "nohang_*_all.deb")
#: the guard's journal line that says it sent SIGTERM (sparkguard: guard/act.py's ``sigterm`` event;
#: earlyoom 1.7: "sending SIGTERM to process"; nohang 0.2: "Sending SIGTERM to the victim")
SIGTERM_LINE = {"sparkguard": re.compile(r"^sigterm: SIGTERM"), "earlyoom": re.compile(r"sending SIGTERM"),
                "nohang": re.compile(r"Sending SIGTERM to the victim")}

HEARTBEAT = r"""
import os, sys, time
path, series = sys.argv[1], sys.argv[2]
guard = sys.argv[3] if len(sys.argv) > 3 else ""
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
sf = open(series, "w", buffering=1)
me = os.open("/proc/self/schedstat", os.O_RDONLY)
try:
    gd = os.open(f"/proc/{int(guard)}/schedstat", os.O_RDONLY)
except (ValueError, OSError):
    gd = None
def stat(f):
    # proc(5) /proc/PID/schedstat: ns on the CPU, ns waiting on a runqueue, timeslices; a running
    # task's CPU is brought up to date at scheduler ticks, so a gap's figures are within one tick
    if f is None:
        return (0, 0)
    try:
        v = os.pread(f, 128, 0).split()
        return (int(v[0]), int(v[1]))
    except (OSError, ValueError, IndexError):
        return (0, 0)
def mem():
    with open("/proc/meminfo") as f:
        m = {l.split(":")[0]: int(l.split()[1]) for l in f}
    return m["MemAvailable"] * 1024, (m["SwapTotal"] - m["SwapFree"]) * 1024, m["MemTotal"] * 1024
last = time.monotonic(); worst = 0.0; worst_at = last; n = 0; next_s = last
s_last, g_last = stat(me), stat(gd)
why = "0 0 0"      # the worst gap's own CPU ms, own runqueue wait ms, the guard's CPU ms
while True:
    time.sleep(0.01)
    now = time.monotonic()
    s_now, g_now = stat(me), stat(gd)
    if now - last > worst:
        worst, worst_at = now - last, now
        why = (f"{(s_now[0] - s_last[0]) / 1e6:.1f} {(s_now[1] - s_last[1]) / 1e6:.1f} "
               f"{(g_now[0] - g_last[0]) / 1e6:.1f}")
    last = now; n += 1; s_last, g_last = s_now, g_now
    os.pwrite(fd, f"{now:.6f} {worst:.6f} {n} {worst_at:.3f} {why}\n".ljust(120).encode(), 0)
    if now >= next_s:
        a, s, t = mem()
        sf.write(f"{now:.3f} {a} {s} {t}\n")
        next_s = now + 0.25
"""

HOG = r"""
import os, signal, sys, time
SHORT_STOP = (768 + 256) << 20     # bytes of MemAvailable where the short fill stops
n, idle, spin, short = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "spin", sys.argv[3] == "short"
t0 = time.monotonic()
print(f"start {t0:.6f}", flush=True)
with open("/var/tmp/hogstart", "w") as f:    # read back even when the run's own answer is lost
    f.write(f"{t0:.6f}\n")
if n == 0:
    time.sleep(idle)
    sys.exit(0)
kids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        if spin:              # the same number of busy processes, no memory: the CPU's share alone
            while True:
                pass
        block = os.urandom(1 << 20)
        held = []
        while True:
            held.append(bytearray(block * 16))
            if short:         # the same fill, stopped 256 MiB above the line: what the fill alone costs
                with open("/proc/meminfo") as f:
                    avail = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:")) << 10
                if avail < SHORT_STOP:
                    time.sleep(1)
                    os._exit(0)
    kids.append(pid)
def forward(sig, frame):
    print(f"term {time.monotonic() - t0:.2f}", flush=True)
    for k in kids:
        try:
            os.kill(k, signal.SIGTERM)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, forward)
if spin:
    time.sleep(idle)
    forward(None, None)
left = set(kids)
while left:
    try:
        pid, st = os.wait()
    except InterruptedError:
        continue
    left.discard(pid)
    print(f"worker {pid} {os.waitstatus_to_exitcode(st)} {time.monotonic() - t0:.2f}", flush=True)
"""

#: one run inside: the heartbeat, the hog, the heartbeat ended 1 s after the hog
RUN = """python3 /var/tmp/heartbeat.py /var/tmp/hb /var/tmp/series "$4" & hb=$!
sleep 1
python3 /var/tmp/{tag}.py "$1" "$2" "$3"
echo hogrc $?
sleep 1
kill $hb; wait $hb 2>/dev/null
echo hbdone
""".format(tag=TAG)


def log(msg: str) -> None:
    print(f"[vm_oom] {msg}", file=sys.stderr, flush=True)


def setup(vm) -> dict:
    """The wheel, ``sparkguard install``, the seed's tuning, earlyoom and nohang; returns the VM's facts."""
    vm.run(f"{nspawn.VENV}/bin/sparkguard", "install", timeout=300)
    vm.run("systemctl", "start", "sparkguard-setup.service", timeout=300)
    vm.put("/etc/sparkguard/sparkguard.yaml", f"targets:\n  match: ['{TAG}']\n".encode())
    vm.put("/usr/sbin/policy-rc.d", b"#!/bin/sh\nexit 101\n", mode=0o755)
    names = []
    for pat in DEBS:
        found = sorted(glob.glob(f"/var/cache/apt/archives/{pat}"))
        if not found:
            raise SystemExit(f"vm_oom: no {pat} in /var/cache/apt/archives (run tests/install-deps)")
        names.append(f"/var/tmp/{Path(found[-1]).name}")
        vm.put(names[-1], Path(found[-1]).read_bytes())
    # earlyoom depends on lsb-base, an empty transitional package in Debian 12 (its init script's
    # helper): the binary and unit need nothing of it
    vm.run("dpkg", "-i", "--force-depends", *names, timeout=300)
    vm.run("rm", "-f", "/usr/sbin/policy-rc.d", *names)
    vm.run("systemctl", "disable", "--now", "earlyoom", "nohang", check=False, timeout=120)
    vm.put("/etc/default/earlyoom", (f'EARLYOOM_ARGS="-M {TERM_BELOW // 1024},{KILL_BELOW // 1024} '
                                     f'-s 100,100 --prefer {TAG} -r 0"\n').encode())
    conf = vm.run("cat", "/etc/nohang/nohang.conf").stdout
    vm.put("/etc/nohang/nohang.conf", headtohead.nohang_config(conf, f"{TERM_BELOW // MiB} M",
                                                               f"{KILL_BELOW // MiB} M", TAG).encode())
    vm.put("/var/tmp/heartbeat.py", HEARTBEAT.encode())
    vm.put(f"/var/tmp/{TAG}.py", HOG.encode())
    vm.put("/var/tmp/run.sh", RUN.encode())
    return {"memory_mib": vm.memory_mib, "cpus": vm.cpus, "accel": vm.accel,
            "kernel": vm.run("uname", "-r").stdout.strip(),
            "swaps": vm.run("cat", "/proc/swaps").stdout.splitlines()[1:],
            "sysctls": {k: vm.run("sysctl", "-n", k).stdout.strip()
                        for k in ("vm.swappiness", "vm.watermark_scale_factor", "vm.page-cluster")},
            "versions": vm.sh("dpkg-query -W earlyoom nohang; sparkguard --version", check=False).stdout.split("\n")}


def meminfo(vm) -> dict:
    m = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in vm.run("cat", "/proc/meminfo").stdout.splitlines()}
    return {"mem_available_mib": m["MemAvailable"] // MiB, "swap_used_mib": (m["SwapTotal"] - m["SwapFree"]) // MiB}


def guard_cpu(vm, unit: str) -> int | None:
    """CPU nanoseconds the unit has used (systemd's CPUUsageNSec; None when not accounted)."""
    cpu = vm.run("systemctl", "show", "-P", "CPUUsageNSec", unit, check=False).stdout.strip()
    return int(cpu) if cpu.isdigit() else None


def settle(vm, timeout: float = 120) -> dict:
    """Wait (bounded) until no hog is left and the swap in use is back under 64 MiB; returns meminfo."""
    vm.run("rm", "-f", "/var/tmp/hogstart", "/var/tmp/hb", "/var/tmp/series")
    vm.sh(f"t=0; while pgrep -f /var/tmp/{TAG}.py >/dev/null && [ $t -lt 600 ]; do sleep 0.1; t=$((t+1)); done",
          check=False, timeout=90)
    deadline = time.monotonic() + timeout
    while True:
        m = meminfo(vm)
        if m["swap_used_mib"] < 64 or time.monotonic() > deadline:
            return m
        time.sleep(1)


def one_run(vm, guard: str, args) -> dict:
    """One run of ``guard`` (see the module docstring); returns its figures."""
    unit = {"sparkguard": "sparkguard", "earlyoom": "earlyoom", "nohang": "nohang"}.get(guard)
    before = settle(vm)
    cpu0 = 0
    if unit:
        vm.run("systemctl", "start", unit, timeout=120)
        time.sleep(3)    # its own start-up (Python imports under TCG) is not part of the run's CPU figure
        cpu0 = guard_cpu(vm, unit)
    main_pid = vm.run("systemctl", "show", "-P", "MainPID", unit).stdout.strip() if unit else ""
    oom_before = int(vm.sh("awk '$1==\"oom_kill\"{print $2}' /proc/vmstat").stdout)
    dmesg_before = len(vm.run("dmesg").stdout.splitlines())
    procs = 0 if guard == "idle" else args.procs
    rtts: list[float] = []
    lost = [0]
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                vm.run("true", timeout=5, check=False)   # rc -9: `true` took over 5 s inside; still counted
                rtts.append(time.monotonic() - t)
            except TimeoutError:
                lost[0] += 1
            stop.wait(max(0.0, 1.0 - (time.monotonic() - t)))

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    t0 = time.monotonic()
    try:
        r = vm.run("/bin/sh", "/var/tmp/run.sh", str(procs), str(args.idle_seconds),
                   {"busy": "spin", "short": "short"}.get(guard, "fill"), main_pid, check=False,
                   timeout=args.seconds + 10)
    except TimeoutError:
        r = None  # the agent could not even kill the hog and answer: the guest stopped answering
    wall = time.monotonic() - t0
    stop.set()
    pinger.join(timeout=60)
    recovered = None
    while r is None and time.monotonic() - t0 < args.seconds + 40 + args.recover:
        try:
            if vm.run("true", timeout=5, check=False).returncode == 0:
                recovered = round(time.monotonic() - t0 - wall, 1)
                break
        except TimeoutError:
            continue
    res = {"guard": guard, "procs": procs, "before": before, "wall_s": round(wall, 1),
           "hog_run": "unanswered" if r is None else ("timed out" if r.timed_out else "ended"),
           "agent_back_after_s": recovered, "agent_calls_unanswered": lost[0],
           "agent_rtt_worst_s": round(max(rtts), 3) if rtts else None,
           "agent_rtt_median_s": round(statistics.median(rtts), 3) if rtts else None}
    if r is None and recovered is None:
        res["answered"] = False
        res["console_oom_kills"] = [ln for ln in vm.console(100000).splitlines() if "Killed process" in ln]
        return res
    out = r.stdout if r is not None else ""
    try:
        start = float(vm.run("cat", "/var/tmp/hogstart", check=False).stdout)
    except ValueError:
        start = None
    hb = vm.run("cat", "/var/tmp/hb", check=False).stdout.split()
    res["heartbeat_worst_stall_s"] = round(float(hb[1]) - 0.01, 3) if len(hb) >= 2 else None
    res["heartbeat_beats"] = int(hb[2]) if len(hb) >= 3 else None
    if len(hb) >= 4 and start is not None:   # when the worst gap ended, from the hog's start
        res["heartbeat_worst_at_s"] = round(float(hb[3]) - start, 2)
    if len(hb) >= 7:     # within the worst gap: the heartbeat's CPU, its runqueue wait, the guard's CPU (ms)
        res["heartbeat_worst_gap_ms"] = {"own_cpu": float(hb[4]), "runqueue_wait": float(hb[5]),
                                         "guard_cpu": float(hb[6])}
    series = [tuple(float(x) for x in ln.split()) for ln in
              vm.run("cat", "/var/tmp/series", check=False).stdout.splitlines() if len(ln.split()) == 4]
    if series and start is not None:
        used = [(t, total - avail + swap) for t, avail, swap, total in series]
        u0 = [u for t, u in used if t <= start]
        u2 = [u for t, u in used if t <= start + 2.0]
        if u0 and u2 and procs:
            res["fill_mib_per_s"] = round((u2[-1] - u0[-1]) / 2.0 / MiB)
        res["mem_available_lowest_mib"] = round(min(a for t, a, s, tot in series if start is None or t >= start) / MiB)
        res["swap_used_highest_mib"] = round(max(s for t, a, s, tot in series) / MiB)
    if unit:
        cpu = guard_cpu(vm, unit)
        res["guard_cpu_s"] = round((cpu - cpu0) / 1e9, 2) if cpu is not None and cpu0 is not None else None
    if unit and start is not None:
        j = vm.run("journalctl", "-u", unit, "-o", "json", "--no-pager", check=False, timeout=120).stdout
        lines = []
        for ln in j.splitlines():
            try:
                e = json.loads(ln)
            except ValueError:
                continue
            t = int(e.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
            if t >= start and isinstance(e.get("MESSAGE"), str):
                lines.append((round(t - start, 2), e["MESSAGE"][:200]))
        terms = [ln for ln in lines if SIGTERM_LINE[guard].search(ln[1])]
        res["sigterms"] = len(terms)
        res["first_sigterm_s"] = terms[0][0] if terms else None
        res["guard_lines"] = lines[:8]
        vm.run("systemctl", "stop", unit, timeout=120)
    res["oom_kills"] = int(vm.sh("awk '$1==\"oom_kill\"{print $2}' /proc/vmstat").stdout) - oom_before
    res["oom_killed"] = [ln for ln in vm.run("dmesg").stdout.splitlines()[dmesg_before:] if "Killed process" in ln]
    if res["oom_killed"] and start is not None:   # dmesg's clock: the kernel's local_clock, ~CLOCK_MONOTONIC
        m = re.match(r"\[\s*([\d.]+)\]", res["oom_killed"][0])
        res["first_oom_kill_s"] = round(float(m.group(1)) - start, 1) if m else None
    res["host_load_1min"] = round(os.getloadavg()[0], 2)   # the host's CPUs run the emulation too
    res["hog_exits"] = [ln for ln in out.splitlines() if ln.startswith(("worker ", "hogrc", "term "))]
    return res


def victims(res: dict) -> str:
    names = [m.group(1) for ln in res.get("oom_killed", []) for m in [re.search(r"Killed process \d+ \(([^)]*)\)", ln)]
             if m]
    return ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names)) or "-"


def gap(res: dict) -> str:
    """The heartbeat's worst gap, taken apart: its own CPU, its wait on a runqueue (runnable, not
    running), the guard's CPU in the same gap (ms; /proc/PID/schedstat, proc(5))."""
    g = res.get("heartbeat_worst_gap_ms")
    if not g:
        return "-"
    return f"{g['own_cpu']:g}, {g['runqueue_wait']:g}, {g['guard_cpu']:g}"


def table(results: list[dict]) -> str:
    rows = ["| guard | hog procs | fill MiB/s | heartbeat worst stall s | agent worst s (unanswered) | "
            "first SIGTERM s | kernel OOM kills (who, first s) | lowest MemAvailable MiB | swap used MiB | "
            "guard CPU s | run s | worst gap: own CPU, runqueue wait, guard CPU ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def f(k, d="-"):
            v = r.get(k)
            return d if v is None else str(v)
        rows.append(f"| {r['guard']} | {r['procs']} | {f('fill_mib_per_s')} | {f('heartbeat_worst_stall_s', 'no answer')} | "
                    f"{f('agent_rtt_worst_s')} ({r.get('agent_calls_unanswered', 0)}) | {f('first_sigterm_s')} | "
                    f"{f('oom_kills', '?')} ({victims(r)}; {f('first_oom_kill_s')}) | {f('mem_available_lowest_mib')} | "
                    f"{f('swap_used_highest_mib')} | {f('guard_cpu_s')} | {f('wall_s')} | {gap(r)} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4, help="hog worker processes (default 4)")
    ap.add_argument("--seconds", type=float, default=90, help="longest run of the hog (default 90)")
    ap.add_argument("--idle-seconds", type=float, default=30, help="the idle baseline's length (default 30)")
    ap.add_argument("--guards", default=",".join(GUARDS), help=f"runs, in order (default {','.join(GUARDS)})")
    ap.add_argument("--recover", type=float, default=240,
                    help="seconds to wait for a guest that stopped answering (default 240)")
    ap.add_argument("--out", help="write the command, the VM's facts and the table to this file")
    args = ap.parse_args()
    guards = [g for g in args.guards.split(",") if g]
    bad = [g for g in guards if g not in GUARDS]
    if bad:
        ap.error(f"--guards: unknown {bad}; known: {', '.join(GUARDS)}")
    reason = qemu.unavailable_reason()
    if reason:
        print(f"vm_oom: cannot run here: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds through the finally below, which powers the guest off and ends QEMU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    qemu.reap_stale()
    img = image.cached_image(log=log)
    wheel_dir = tempfile.mkdtemp(prefix="vm_oom-")
    wheel = nspawn.build_wheel(Path(wheel_dir))
    vm = qemu.VM(img)
    results = []
    try:
        vm.start()
        log(f"booted in {vm.boot_seconds[-1]} s")
        vm.put(f"/var/tmp/{wheel.name}", wheel.read_bytes())
        vm.run(f"{nspawn.VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps", f"/var/tmp/{wheel.name}",
               timeout=300)
        facts = setup(vm)
        log(f"VM: {json.dumps(facts)}")
        for g in guards:
            log(f"run: {g}")
            res = one_run(vm, g, args)
            results.append(res)
            print(json.dumps(res, indent=1), flush=True)
            if res.get("answered") is False:
                log("the guest stopped answering: no further runs")
                break
    finally:
        vm.close()
        shutil.rmtree(wheel_dir, ignore_errors=True)
    text = "\n".join([
        "command: python3 bench/vm_oom.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"VM: {facts['memory_mib']} MiB, {facts['cpus']} vCPUs, {facts['accel'].upper()}, kernel {facts['kernel']}",
        f"swaps: {facts['swaps']}", f"sysctls: {facts['sysctls']}", f"versions: {facts['versions']}",
        f"lines: SIGTERM below {TERM_BELOW // MiB} MiB MemAvailable (all three), SIGKILL below {KILL_BELOW // MiB} MiB "
        "(earlyoom, nohang; sparkguard after its 5 s grace); hog preferred by its command line",
        "", table(results), ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\nruns (JSON):\n" + "\n".join(json.dumps(r) for r in results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

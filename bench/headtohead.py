#!/usr/bin/env python3
"""Head-to-head: sparkguard vs earlyoom vs nohang against the same memory hogs.

Run as root from the repository root (not part of the test suite; about 35 minutes with the
defaults: 135 trials and the 60 s idle run)::

    python3 bench/headtohead.py                 # everything, 5 trials
    python3 bench/headtohead.py --trials 3 --only sparkguard --scenarios plain --no-idle
    git worktree add /tmp/sg-base HEAD~1        # a change side by side with the code before it
    python3 bench/headtohead.py --only sparkguard --baseline /tmp/sg-base

Each trial starts one guard and one hog (``bench/hog.py``) together in a fresh PID
namespace with its own /proc (``unshare --pid --fork --mount-proc --kill-child``), so the
guard can see, and therefore signal, nothing but the hog: a peer that picks its victim by
badness cannot hit anyone else's process on this shared machine.  Every guard gets the
same SIGTERM line (``term``: MemAvailable now minus --headroom) and the same SIGKILL
line (``kill``: one GiB lower): earlyoom ``-M term,kill`` (KiB) plus ``--prefer``,
nohang ``soft/hard_threshold_min_mem`` (MiB) plus a cmdline badness bonus, sparkguard
``guard.term_below/kill_below`` and a ``targets.match`` of the hog's unique tag.  Each
runs at its default cadence.

The hog stamps, with CLOCK_MONOTONIC (system-wide, so comparable across processes),
when its own 0.5 ms sampler first saw MemAvailable under the line and when SIGTERM
arrived; it streams the lowest MemAvailable it saw.  Per trial: crossing-to-SIGTERM
latency, overshoot (line minus the lowest MemAvailable), SIGTERM-to-exit, time from the
crossing until MemAvailable was back above the line with the hog gone, the kernel's
oom_kill counter delta (/proc/vmstat, machine-wide) and whether the hog died at all.

Scenarios: ``plain`` (exits at SIGTERM), ``ignore`` (ignores SIGTERM: only SIGKILL at the
kill line or after a grace ends it), ``tree`` (12 child processes fill; the root forwards
SIGTERM to them, children killed one by one are not replaced).  Tiers: ``0.5GiB/s``,
``full1`` (one thread at full speed; in the tree the same total rate, measured first),
``full2`` (two threads at full speed; in the tree all children at full speed).

Issue 17's scenarios (``--scenarios step,loadserve``), one shape each instead of the tiers:
``step`` is one allocation of ``--step-gib`` GiB at once (``mmap(MAP_POPULATE)``, as a driver
allocation is), more than the headroom; ``loadserve`` is a load that falls steeply
(``--load-rate``) and stops ``--load-margin`` GiB above the line, then a serving leak
(``--leak-rate``) that crosses it.  A SIGTERM before the load is done is a false SIGTERM.  The
guards ``sparkguard+rate`` (this checkout, ``guard.rate_trigger: on``) and ``sparkguard+phase``
(the same, supervising the hog as its engine: ready once the hog's port listens after the load,
so the load phase's lines apply until then; loadserve only) run beside the others
(``--only sparkguard,sparkguard+rate,sparkguard+phase,earlyoom,nohang``).  Their table counts the
trials that crossed the line at all and those whose SIGTERM came before the crossing.

Bystanders (``--bystanders 0,5000``): each trial also runs with N sleeping processes started in
its namespace before the guard (so the guard sees them in /proc, as on a busy box), and the
line is placed after they are up; every count is a trial of its own, so one run compares them.
They die with the namespace.

CPU saturation (``--spinners 2x --sched nice-20,rr``): busy loops in the namespace (2 per CPU)
and sparkguard started under each scheduling in turn: ``nice -n -20`` (the unit's Nice=-20),
``chrt -r 1`` (SCHED_RR priority 1, threads and children inherit it), ``chrt --reset-on-fork -r 1``
(CPUSchedulingResetOnFork=yes: threads start at SCHED_OTHER nice 0).

Idle: the three guards run side by side for --idle-seconds with the line 8 GiB away (--idle-headroom;
more on a shared host whose MemAvailable wanders: sparkguard's idle fast path needs 6.4 GiB; with
--idle-copies N, N processes of each, compared by their medians), and
beside them the floors: the plainest loop at sparkguard's default cadence (read /proc/meminfo,
sleep 200 ms) in Python and, where ``cc`` exists, in C, and ``floor_python_check``, the Python
one that also finds, parses and compares MemAvailable on each read (a guard's least work).  Per process: CPU seconds of all
threads from /proc/PID/task/*/schedstat (nanoseconds; utime+stime's 10 ms ticks are too
coarse for 0.05 %), wake-ups per second and CPU microseconds per wake-up, VmRSS at the end.
sparkguard's hot per-poll cost is measured in-process (sample + decision + next interval).

Memory safety: the hog stops filling once MemAvailable is 2 GiB under the line or after
``headroom + 2.5 GiB``; a trial that does not end in --trial-timeout seconds is ended by
SIGKILLing the namespace.  Needs >= 8 GiB MemAvailable to start.

Cleanup: SIGINT (Ctrl-C), SIGTERM and SIGHUP end the bench through its ``finally`` blocks,
which SIGKILL every namespace (rows so far are summarised and written; exit 130, 143, 129).
Should the bench itself be SIGKILLed, each ``unshare`` has the parent-death signal SIGKILL
(``setpriv --pdeathsig KILL``, prctl(2) PR_SET_PDEATHSIG), and its ``--kill-child`` passes
that on to the namespace's init, whose death kills every process inside (pid_namespaces(7)):
no guard or hog outlives the bench.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import select
import mmap
import ctypes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = os.path.join(ROOT, "bench", "hog.py")
GiB, MiB = 1 << 30, 1 << 20
SCENARIOS = ("plain", "ignore", "tree")
#: scenarios of issue 17 (``--scenarios step,loadserve``): each has one shape, not the fill tiers
SHAPED = {"step": "once", "loadserve": "load"}
TIERS = ("0.5GiB/s", "full1", "full2")
GUARDS = ("sparkguard", "earlyoom", "nohang")
#: sparkguard variants (``--only sparkguard+rate,sparkguard+phase``): this checkout with the rate trigger on
#: (guard.rate_trigger, docs/rate.md), and with it on while sparkguard supervises the hog as its
#: engine, so the load phase's lines apply until the hog's port listens (loadserve only)
VARIANTS = {"sparkguard+rate": {"guard": {"rate_trigger": "on"}},
            "sparkguard+phase": {"guard": {"rate_trigger": "on"}}}
PHASED = "sparkguard+phase"
TREE_PROCS = 12
#: spawns argv[1] sleeping processes (``--bystanders``; about 200 KiB of memory each) and argv[2]
#: busy loops (``--spinners``), then exits
SPAWN_PY = ("import os, sys\nfor _ in range(int(sys.argv[1])):\n"
            "    os.posix_spawn('/bin/sleep', ['sleep', '1000000'], {})\n"
            "for _ in range(int(sys.argv[2])):\n"
            "    os.posix_spawn('/bin/sh', ['sh', '-c', 'while :; do :; done'], {})\n")
#: how the sparkguard guard is started (``--sched``): a prefix to its argv
#: guard name -> the sparkguard source folder it runs ("sparkguard" is this checkout; ``--baseline
#: DIR`` adds "sparkguard@base", another checkout of the same repository, run side by side)
SOURCES = {"sparkguard": ROOT}
SCHED = {"default": [], "nice-20": ["nice", "-n", "-20"], "rr": ["chrt", "-r", "1"],
         "rr-reset": ["chrt", "--reset-on-fork", "-r", "1"]}


def mem_available() -> int:
    """MemAvailable, bytes."""
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def oom_kills() -> int:
    """The kernel OOM killer's counter (/proc/vmstat oom_kill)."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- the guards


def nohang_config(text: str, term: str, kill: str, tag: str, extra: dict | None = None) -> str:
    """nohang.conf ``text`` with its memory lines set to ``term``/``kill`` (nohang's units, e.g.
    ``"768 M"``), its swap lines at 100 % (act on memory alone: a zram larger than RAM, or no
    swap, never looks low), the ``extra`` keys set, and processes whose command line matches
    ``tag`` preferred (``@BADNESS_ADJ_RE_CMDLINE``).  Also used by bench/vm_oom.py."""
    sets = {"soft_threshold_min_mem": term, "hard_threshold_min_mem": kill,
            "soft_threshold_min_swap": "100 %", "hard_threshold_min_swap": "100 %", **(extra or {})}
    out = []
    for ln in text.splitlines():
        key = ln.split("=", 1)[0].strip()
        out.append(f"{key} = {sets[key]}" if "=" in ln and not ln.lstrip().startswith("#") and key in sets else ln)
    out.append(f"@BADNESS_ADJ_RE_CMDLINE 900 /// {tag}")
    return "\n".join(out) + "\n"


def guard_cmd(name: str, term: int, kill: int, tag: str, work: str, sched: str = "default",
              engine: tuple[list[str], int] | None = None) -> tuple[list[str], str]:
    """argv for one guard configured to SIGTERM below ``term`` and SIGKILL below ``kill`` (bytes),
    and a substring of its output that says it is watching.  ``sched`` (sparkguard only): a key
    of :data:`SCHED`, the CPU scheduling it starts with (nice -20 as the unit's Nice=-20, SCHED_RR
    priority 1 as CPUSchedulingPolicy=rr, with or without CPUSchedulingResetOnFork).  A name of
    :data:`VARIANTS` runs this checkout with that config added; ``engine`` ``(hog argv, port)``
    (for :data:`PHASED`) makes the hog sparkguard's supervised engine, ready once the port answers."""
    if name == "earlyoom":
        # -M in KiB; -s 100,100: earlyoom acts only when swap is low too, and a host without swap
        # (this one) counts as 0 % free, which 100 % always satisfies.
        return (["earlyoom", "-M", f"{term // 1024},{kill // 1024}", "-s", "100,100", "--prefer", tag, "-r", "0"],
                "sending SIGTERM when")
    if name == "nohang":
        conf = os.path.join(work, "nohang.conf")
        with open("/etc/nohang/nohang.conf") as f:
            text = nohang_config(f.read(), f"{term / MiB:.1f} M", f"{kill / MiB:.1f} M", tag,
                                 {"print_victim_status": "True", "separate_log": "False"})
        with open(conf, "w") as f:
            f.write(text)
        # nohang refuses thresholds above 50 % of MemTotal (a config sanity check, nothing
        # else); the line here sits a little under the MemAvailable of a mostly idle host,
        # so run a copy with that one check widened.  Its logic is otherwise untouched.
        exe = os.path.join(work, "nohang")
        with open("/usr/sbin/nohang") as f:
            src = f.read()
        patched = src.replace("mem_min_kb > mem_total * 0.5", "mem_min_kb > mem_total * 0.99")
        assert patched != src, "nohang's 50 % check not found"
        with open(exe, "w") as f:
            f.write(patched)
        os.chmod(exe, 0o755)
        return ["python3", exe, "--monitor", "-c", conf], "Monitoring has started"
    if name in SOURCES or name in VARIANTS:
        conf = os.path.join(work, "sparkguard.yaml")
        doc = {"guard": {"term_below": term, "kill_below": kill},
               "targets": {"match": [tag]}, "metrics": {"listen": "off"},
               "incidents": {"dir": os.path.join(work, "incidents"), "journal": "off"}}
        for sec, body in VARIANTS.get(name, {}).items():
            doc.setdefault(sec, {}).update(body)
        if engine is not None:
            argv, port = engine
            doc["engine"] = {"command": argv, "health_url": f"http://127.0.0.1:{port}/health",
                             "health_interval": "100ms", "ready_timeout": "600s", "restart": "never",
                             "drop_caches": False, "start_above": "64MiB", "stable_for": "0s",
                             "quiesce_timeout": "60s", "log": "stderr",
                             "state_file": os.path.join(work, "engine-state.json"),
                             "control_socket": os.path.join(work, "control.sock")}
        with open(conf, "w") as f:
            json.dump(doc, f)
        # `sparkguard run` as the unit runs it, imported from this guard's own source folder
        # (python -c puts the working directory first on sys.path: the folder goes before it)
        return SCHED[sched] + [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                               "from sparkguard.cli import main; sys.exit(main(['run', '--config', sys.argv[2]]))",
                               SOURCES.get(name, ROOT), conf], "started:"
    raise ValueError(name)


class Namespace:
    """``setpriv --pdeathsig KILL unshare --pid --fork --mount-proc --kill-child sh -c 'GUARD & HOG; wait'``.

    SIGKILL of the unshare process kills the namespace's init (``--kill-child``: its
    PDEATHSIG), and with it every process inside (pid_namespaces(7)).  unshare itself gets
    SIGKILL when the bench's thread that started it dies (``setpriv --pdeathsig``, prctl(2)),
    so a SIGKILLed bench leaves nothing running either.  unshare runs in its own session, so a
    Ctrl-C on the terminal reaches only the bench, which then closes the namespace."""

    def __init__(self, guard_argv: list[str] | None, hog_argv: list[str] | None, log: str, bystanders: int = 0,
                 spinners: int = 0):
        # The commands travel in the environment, not in sh's cmdline: sh is the namespace's
        # init, and a guard matching the hog's tag in its cmdline would see init as the top
        # of the hog's tree (protected: PID 1) instead of the hog.
        script = 'eval "$SG_GUARD" >"$SG_LOG" 2>&1 &\n' + \
            ('eval "$SG_HOG"\n' if hog_argv or bystanders or spinners else "") + "wait\n"
        self.log = log
        self.ready, self.cmds = log + ".bystanders", log + ".cmds"
        if bystanders or spinners:
            # ``bystanders`` sleeping processes and ``spinners`` busy loops first (their spawner
            # exits: sh, the namespace's init, adopts them and they die with it); then sh waits
            # for the commands, which :meth:`launch` writes once the bench has read MemAvailable
            # with them in place
            script = (f'"$SG_PYTHON" -c "$SG_SPAWN" {int(bystanders)} {int(spinners)} && : >"$SG_READY"\n'
                      'while [ ! -e "$SG_CMDS" ]; do sleep 0.05; done\n. "$SG_CMDS"\n' + script)
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", SG_GUARD=shlex.join(guard_argv or []),
                   SG_HOG=shlex.join(hog_argv or []), SG_LOG=log, SG_PYTHON=sys.executable, SG_SPAWN=SPAWN_PY,
                   SG_READY=self.ready, SG_CMDS=self.cmds)
        self.proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL",
                                      "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                                      "sh", "-c", script], env=env, start_new_session=True)

    def wait_log(self, needle: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                with open(self.log, errors="replace") as f:
                    if needle in f.read():
                        return True
            except FileNotFoundError:
                pass
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def wait_bystanders(self, timeout: float) -> bool:
        """Wait until the bystanders are running (a namespace made with ``bystanders``)."""
        end = time.monotonic() + timeout
        while not os.path.exists(self.ready):
            if time.monotonic() > end or self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def launch(self, guard_argv: list[str], hog_argv: list[str] | None) -> None:
        """Start the guard and the hog in a namespace made with ``bystanders`` (written atomically)."""
        tmp = self.cmds + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"SG_GUARD={shlex.quote(shlex.join(guard_argv))}\nSG_HOG={shlex.quote(shlex.join(hog_argv or []))}\n")
        os.replace(tmp, self.cmds)

    def pids(self) -> list[int]:
        """Host pids of every process inside (descendants of unshare)."""
        kids: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        s = f.read()
                except OSError:
                    continue
                ppid = int(s[s.rfind(")") + 2:].split()[1])
                kids.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.proc.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(kids.get(p, ()))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------- one trial


def calibrate_one_thread(size: int = 1 * GiB) -> float:
    """Full-speed fill rate of one thread here (mmap + memset), bytes/s."""
    libc = ctypes.CDLL(None)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    maps = []
    t0 = time.monotonic()
    for _ in range(size // (8 * MiB)):
        m = mmap.mmap(-1, 8 * MiB)
        libc.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, 8 * MiB)
        maps.append(m)
    dt = time.monotonic() - t0
    del maps
    return size / dt


def hog_args(scenario: str, tier: str, one_thread_rate: float, tree_procs: int = TREE_PROCS, args=None) -> list[str]:
    """The hog's options for one scenario and tier.  ``step``: one allocation of ``--step-gib`` GiB
    (more than the headroom: it crosses the line in one call); ``loadserve``: a load of
    ``headroom - --load-margin`` GiB at ``--load-rate`` GiB/s that stops above the line, then a serving
    leak at ``--leak-rate`` GiB/s that crosses it."""
    if scenario == "step":
        return ["--step", str(int(args.step_gib * GiB))]
    if scenario == "loadserve":
        return ["--load-bytes", str(int((args.headroom - args.load_margin) * GiB)),
                "--load-rate", str(int(args.load_rate * GiB)), "--leak-rate", str(int(args.leak_rate * GiB))]
    if scenario == "tree":
        rate = {"0.5GiB/s": 0.5 * GiB, "full1": one_thread_rate, "full2": 0}[tier]
        return ["--procs", str(tree_procs), "--rate", str(int(rate))]
    rate = 0.5 * GiB if tier == "0.5GiB/s" else 0
    return ["--threads", "2" if tier == "full2" else "1", "--rate", str(int(rate))] + \
        (["--ignore-term"] if scenario == "ignore" else [])


def free_port() -> int:
    """A TCP port free on loopback now (the phased trial's hog listens on it once loaded)."""
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def settle(target: int, timeout: float = 20.0) -> int:
    """Wait until MemAvailable is back near ``target`` (others' tests move it too)."""
    end = time.monotonic() + timeout
    a = mem_available()
    while a < target - 256 * MiB and time.monotonic() < end:
        time.sleep(0.1)
        a = mem_available()
    return a


def run_trial(guard: str, scenario: str, tier: str, args, one_thread_rate: float, bystanders: int = 0,
              sched: str = "default") -> dict:
    """One guard against one hog, beside ``bystanders`` sleeping processes and ``args.spinners``
    busy loops in the same namespace (started before the guard; the line is placed after they
    are up), the guard started with ``sched``; returns the row."""
    work = tempfile.mkdtemp(prefix="sg-h2h-")
    tag = "sghog" + uuid.uuid4().hex[:10]
    spin = spinners(getattr(args, "spinners", "0"))
    row = {"guard": guard, "scenario": scenario, "tier": tier, "bystanders": bystanders, "spinners": spin,
           "sched": sched if guard in SOURCES else "default", "error": ""}
    ns = Namespace(None, None, os.path.join(work, "guard.log"), bystanders, spin) if bystanders or spin else None
    try:
        if ns is not None and not ns.wait_bystanders(120):
            row["error"] = "bystanders did not start"
            return row
        return _trial(ns, row, work, tag, guard, scenario, tier, args, one_thread_rate)
    finally:
        if ns is not None:
            ns.close()
        if args.keep_logs:
            print(f"   logs in {work}")
        else:
            subprocess.run(["rm", "-rf", work])


def spinners(spec: str) -> int:
    """``--spinners``: a number, or ``Nx`` for N times the CPUs this bench may use."""
    spec = str(spec).strip()
    return int(float(spec[:-1]) * len(os.sched_getaffinity(0))) if spec.endswith("x") else int(spec or 0)


def _trial(ns, row: dict, work: str, tag: str, guard: str, scenario: str, tier: str, args,
           one_thread_rate: float) -> dict:
    avail0 = mem_available()
    term = avail0 - int(args.headroom * GiB)
    kill = term - GiB
    cap = term - 2 * GiB
    report, go = os.path.join(work, "report"), os.path.join(work, "go")
    os.mkfifo(report)
    os.mkfifo(go)
    rfd = os.open(report, os.O_RDONLY | os.O_NONBLOCK)
    hargv = [sys.executable, HOG, "--tag", tag, "--report", report, "--go", go, "--line", str(term),
             "--cap", str(cap), "--max-bytes", str(int((args.headroom + 2.5) * GiB))] + \
        hog_args(scenario, tier, one_thread_rate, getattr(args, "tree_procs", TREE_PROCS), args)
    engine = None
    if guard == PHASED:      # the hog is sparkguard's engine: loading until its port answers
        port = free_port()
        hargv += ["--port", str(port)]
        engine = (hargv, port)
    gargv, ready = guard_cmd(guard, term, kill, tag, work, row["sched"], engine)
    row["line_bytes"] = term
    if ns is None:
        ns = Namespace(gargv, None if engine else hargv, os.path.join(work, "guard.log"))
    else:
        ns.launch(gargv, hargv)
    buf = b""
    ev: dict = {"T": [], "M": None, "C": None, "X": [], "S": [], "P": None, "L": None}
    try:
        if not ns.wait_log(ready, 20):
            row["error"] = "guard did not start: " + open(ns.log, errors="replace").read()[-300:].replace("\n", " | ")
            return row
        # wait for the hog's R line
        end = time.monotonic() + 20
        got_r = False
        while time.monotonic() < end and not got_r:
            r, _, _ = select.select([rfd], [], [], 0.1)
            if r:
                chunk = os.read(rfd, 65536)
                buf += chunk
                got_r = b"R " in buf
        if not got_r:
            row["error"] = "hog did not start"
            return row
        time.sleep(0.3)       # let the guard settle into its idle cadence
        oom0 = oom_kills()
        gfd = None
        while gfd is None and time.monotonic() < end:
            try:
                gfd = os.open(go, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.01)
        t_go = time.monotonic()
        a_go = mem_available()
        os.write(gfd, b"g")
        os.close(gfd)
        deadline = t_go + args.trial_timeout
        eof = False
        while time.monotonic() < deadline:
            r, _, _ = select.select([rfd], [], [], 0.05)
            if not r:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                eof = True
                break
            buf += chunk
        t_end = time.monotonic()
        if not eof:
            ns.close()       # nobody stopped the hog: end it ourselves
            t_end = time.monotonic()
        while True:
            try:
                chunk = os.read(rfd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            p = line.split()
            if not p:
                continue
            if p[0] == "C" and ev["C"] is None:
                ev["C"] = float(p[1])
            elif p[0] == "M":
                ev["M"] = int(p[1]) if ev["M"] is None else min(ev["M"], int(p[1]))
            elif p[0] == "T":
                ev["T"].append(float(p[2]))
            elif p[0] == "X":
                ev["X"].append(float(p[2]))
            elif p[0] in ("P", "L") and ev[p[0]] is None:
                ev[p[0]] = float(p[1])
        # memory back above the line (hog gone)
        t_back = None
        lim = time.monotonic() + 15
        while time.monotonic() < lim:
            if mem_available() >= term:
                t_back = time.monotonic()
                break
            time.sleep(0.001)
        oom1 = oom_kills()
        c = ev["C"]
        t_term = min(ev["T"]) if ev["T"] else None
        row.update({
            "fill_gib_s": round((a_go - term) / (c - t_go) / GiB, 2) if c else None,
            "crossed": c is not None,
            "term_latency_ms": round((t_term - c) * 1000, 2) if (c and t_term) else None,
            "overshoot_mib": round((term - ev["M"]) / MiB, 1) if ev["M"] is not None else None,
            "term_to_exit_ms": round((t_end - t_term) * 1000, 1) if (t_term and eof) else None,
            "end_after_cross_ms": round((t_end - c) * 1000, 1) if (c and eof) else None,
            "back_after_cross_ms": round((t_back - c) * 1000, 1) if (c and t_back and eof) else None,
            "oom_kills": oom1 - oom0,
            "stopped": eof,
            "escalated": bool(eof and scenario == "ignore"),
            "terms": len(ev["T"]),
            # loadserve: SIGTERM before the load was done, and before the hog's sampler saw the line
            # crossed (the load stops above it by construction; memory others free or take on a
            # shared host can still move it across)
            "false_term": bool(scenario == "loadserve" and t_term is not None and (ev["L"] is None or t_term < ev["L"])
                               and (c is None or t_term < c)),
            "load_s": round(ev["L"] - t_go, 3) if ev["L"] else None,
            "step_s": round(ev["P"] - t_go, 3) if ev["P"] else None,
            "term_before_cross": bool(t_term is not None and (c is None or t_term < c)),
        })
        if not eof:
            row["error"] = f"hog not stopped within {args.trial_timeout}s"
        return row
    finally:
        ns.close()
        os.close(rfd)


# ---------------------------------------------------------------- idle


def proc_cpu(pid: int) -> tuple[float, int | None]:
    """(CPU seconds, times scheduled in) of every thread of ``pid``.

    From /proc/PID/task/*/schedstat (sum_exec_runtime in ns, and the run count; proc(5),
    Documentation/scheduler/sched-stats.rst) where the kernel has schedstats: exact to the
    nanosecond, where utime+stime moves in 10 ms ticks (0.05 % of a core over 60 s is three
    ticks).  Falls back to utime+stime of /proc/PID/stat (count None)."""
    ns = runs = 0
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                x = f.read().split()
            ns += int(x[0])
            runs += int(x[2])
        return ns / 1e9, runs
    except (OSError, IndexError, ValueError):
        pass
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    fl = s[s.rfind(")") + 2:].split()
    return (int(fl[11]) + int(fl[12])) / os.sysconf("SC_CLK_TCK"), None


#: the floor: what any guard at sparkguard's default cadence must pay on this host, written as
#: plainly as each language allows (one read of /proc/meminfo, one 200 ms sleep, forever)
FLOOR_PY = """import os, select, sys
fd = os.open("/proc/meminfo", os.O_RDONLY)
view = [bytearray(8192)]
poll = select.poll().poll
print("ready", flush=True)
while True:
    os.preadv(fd, view, 0)
    poll(200)
"""
#: the plainest loop that also does a guard's work on each read: find MemAvailable, parse it,
#: compare it with a line (8 GiB under MemAvailable at start, never crossed in the idle run)
FLOOR_PY_CHECK = """import os, select, sys
fd = os.open("/proc/meminfo", os.O_RDONLY)
buf = bytearray(8192)
view = [buf]
poll = select.poll().poll
line = int(sys.argv[1])
print("ready", flush=True)
while True:
    n = os.preadv(fd, view, 0)
    i = buf.find(b"MemAvailable:", 0, n)
    if int(buf[i + 13:buf.find(b" kB", i, n)]) << 10 < line:
        print("below the line", flush=True)
    poll(200)
"""
#: the plainest loop that checks MemAvailable as sparkguard's fast path does: the read lands the
#: MemAvailable line's label and first columns in a window of their own, four byte-string compares
#: with the bounds of sparkguard.meminfo.FastCheck (argv: the text's length before the window, the
#: bounds in hex)
FLOOR_PY_WINDOW = """import os, select, sys
fd = os.open("/proc/meminfo", os.O_RDONLY)
low, high = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
window, last = bytearray(len(low)), bytearray(1)
view = [bytearray(int(sys.argv[1])), window, last]
size = sum(map(len, view))
poll = select.poll().poll
print("ready", flush=True)
while True:
    if os.preadv(fd, view, 0) != size or window < low or window > high or last < b"0" or last > b"9":
        print("below the line", flush=True)
    poll(200)
"""
#: the plainest loop that checks memory as sparkguard's free-memory check does
#: (sparkguard/freepages.py): MemFree in pages from sysconf(_SC_AVPHYS_PAGES), glibc's sysinfo(2),
#: compared with a need (argv[1], pages: the line's); no read of /proc/meminfo
FLOOR_PY_FREE = """import os, select, sys
name = os.sysconf_names["SC_AVPHYS_PAGES"]
need = int(sys.argv[1])
sysconf = os.sysconf
poll = select.poll().poll
print("ready", flush=True)
while True:
    if sysconf(name) < need:
        print("below the line", flush=True)
    poll(200)
"""
#: the plainest loop that checks MemAvailable as sparkguard's fast path did until 2026-12-04, in one
#: C call: buf.startswith(the byte prefixes of every MemAvailable line at or above the line, at the
#: line's offset), the prefixes (:func:`old_prefixes`) in argv[1] (hex, comma-separated); run only
#: where they tell the answer (a value under 10^8 kB, or a wider one a prefix covers)
FLOOR_PY_PREFIX = """import os, select, sys
fd = os.open("/proc/meminfo", os.O_RDONLY)
buf = bytearray(8192)
view = [buf]
poll = select.poll().poll
n = os.preadv(fd, view, 0)
at = buf.find(b"\\nMemAvailable:", 0, n)     # the prefixes begin with the newline before the name
pre = tuple(sorted((bytes.fromhex(x) for x in sys.argv[1].split(",")), key=lambda p: not buf.startswith(p, at, n)))
if not buf.startswith(pre, at, n):
    sys.exit("floor_python_prefix: MemAvailable is not above the line as the prefixes say")
starts = buf.startswith
print("ready", flush=True)
while True:
    if not starts(pre, at, os.preadv(fd, view, 0)):
        print("below the line", flush=True)
    poll(200)
"""


def old_prefixes(line: int) -> tuple[bytes, ...] | None:
    """The MemAvailable lines at or above ``line`` bytes as the byte prefixes sparkguard's fast
    path compared before its window check (meminfo.fast_prefixes then): the newline, the label,
    the kernel's padding and the leading digits of every value of 8 columns or fewer at or above
    the line in kB rounded up to 3 significant digits; None from 10^8 kB."""
    kb = max(1, -(-line // 1024))
    q = 10 ** max(0, len(str(kb)) - 3)
    kb = -(-kb // q) * q
    width = len(str(kb))
    if width > 8:
        return None
    label = b"\nMemAvailable:   "
    digits = str(kb)[:3].encode()
    leading = [digits[:i] + b"%d" % c for i in range(len(digits)) for c in range(digits[i] - 47, 10)] + [digits]
    out = [label + b" " * (8 - w) + b"%d" % c for w in range(8, width, -1) for c in range(1, 10)]
    return tuple(out + [label + b" " * (8 - width) + lead for lead in leading])


#: floor_python's loop in a process set up the way the daemon's is, one part at a time (argv[1], a
#: comma-separated list; SG_FLOOR_ENV=1 adds these rows to the idle run): ``nice`` setpriority -20
#: (guard/harden.py NICE), ``mlock`` mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT), ``threads`` three
#: threads blocked on a lock (the daemon's idle threads), ``switch`` sys.setswitchinterval(0.0005),
#: ``heap`` the daemon's modules imported (its RSS), ``all`` every one of them
FLOOR_PY_ENV = """import os, select, sys
parts = set(sys.argv[1].split(","))
if "all" in parts:
    parts = {"nice", "mlock", "threads", "switch", "heap"}
if "heap" in parts:
    import sparkguard.cli, sparkguard.guard.loop, sparkguard.metrics, sparkguard.supervisor  # noqa: F401
if "switch" in parts:
    sys.setswitchinterval(0.0005)
if "threads" in parts:
    import threading
    held = threading.Lock()
    held.acquire()
    for _ in range(3):
        threading.Thread(target=held.acquire, daemon=True).start()
if "mlock" in parts:
    import ctypes
    assert ctypes.CDLL(None, use_errno=True).mlockall(7) == 0
if "nice" in parts:
    os.setpriority(os.PRIO_PROCESS, 0, -20)
""" + FLOOR_PY.split("\n", 1)[1]       # then floor_python's own lines
FLOOR_ENV_PARTS = ("nice", "mlock", "threads", "switch", "heap", "all")
FLOOR_C = """#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
    char buf[8192];
    int fd = open("/proc/meminfo", O_RDONLY);
    printf("ready\\n"); fflush(stdout);
    for (;;) { pread(fd, buf, sizeof buf, 0); poll(NULL, 0, 200); }
}
"""


def floor_cmds(work: str, line: int) -> dict[str, list[str]]:
    """The floor loops (guard name -> argv): Python always (read only, read + check against
    ``line`` bytes, and sysconf + check of MemFree, ``floor_python_free``), the check as
    sparkguard's fast path makes it (``floor_python_window``) and as
    it made it before (``floor_python_prefix``) where each has one, the read-only loop in a process
    set up as the daemon's (``SG_FLOOR_ENV=1``), C where ``cc`` builds it."""
    py = os.path.join(work, "floor_python.py")
    with open(py, "w") as f:
        f.write(FLOOR_PY)
    check = os.path.join(work, "floor_python_check.py")
    with open(check, "w") as f:
        f.write(FLOOR_PY_CHECK)
    out = {"floor_python": [sys.executable, py], "floor_python_check": [sys.executable, check, str(line)]}
    free = os.path.join(work, "floor_python_free.py")
    with open(free, "w") as f:
        f.write(FLOOR_PY_FREE)
    out["floor_python_free"] = [sys.executable, free, str(line // os.sysconf("SC_PAGE_SIZE"))]
    sys.path.insert(0, ROOT)
    from sparkguard import meminfo
    with open("/proc/meminfo", "rb") as f:
        text = bytearray(f.read())
    check = meminfo.fast_check(text, len(text), line)
    if check is not None:
        window = os.path.join(work, "floor_python_window.py")
        with open(window, "w") as f:
            f.write(FLOOR_PY_WINDOW)
        out["floor_python_window"] = [sys.executable, window, str(len(check.view[0])), check.low.hex(),
                                      check.high.hex()]
    prefixes = old_prefixes(line)
    at = text.find(b"\nMemAvailable:")
    if prefixes is not None and text.startswith(prefixes, at):       # the prefixes tell the answer
        prefix = os.path.join(work, "floor_python_prefix.py")
        with open(prefix, "w") as f:
            f.write(FLOOR_PY_PREFIX)
        out["floor_python_prefix"] = [sys.executable, prefix, ",".join(p.hex() for p in prefixes)]
    if os.environ.get("SG_FLOOR_ENV"):
        for part in FLOOR_ENV_PARTS:      # a file per row: guard_pid finds each by its name
            env = os.path.join(work, f"floor_py_{part}.py")
            with open(env, "w") as f:
                f.write(FLOOR_PY_ENV)
            out[f"floor_py_{part}"] = [sys.executable, env, part]
    src, exe = os.path.join(work, "floor_c.c"), os.path.join(work, "floor_c")
    with open(src, "w") as f:
        f.write(FLOOR_C)
    if subprocess.run(["cc", "-O2", "-o", exe, src], capture_output=True).returncode == 0:
        out["floor_c"] = [exe]
    return out


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def guard_pid(ns: Namespace, guard: str) -> int | None:
    for pid in ns.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("unshare") or cmd.startswith("sh -c"):
            continue
        if guard in cmd:
            return pid
    return None


def sparkguard_poll_cost(n: int = 20000) -> float:
    """Microseconds per idle poll: pread+parse /proc/meminfo, the OK-state check, next_interval."""
    sys.path.insert(0, ROOT)
    from sparkguard import meminfo, policy
    r = meminfo.MeminfoReader()
    line = 1 * GiB
    t0 = time.perf_counter()
    for _ in range(n):
        a, s = r.sample()
        if a < line:
            pass
        policy.next_interval(a - line, 0.2)
    return (time.perf_counter() - t0) / n * 1e6


#: a process that holds anonymous memory (MAP_POPULATE) until killed: argv[1] bytes
HOLD_PY = """import mmap, sys, time
m = mmap.mmap(-1, int(sys.argv[1]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x8000)
print("held", flush=True)
time.sleep(86400)
"""


def idle(seconds: float, guards, floors: bool = True, copies: int = 1, headroom: float = 8.0,
         hold_to: float | None = None) -> list[dict]:
    """The guards (and the floor loops) side by side for ``seconds``, the line ``headroom`` GiB away;
    ``copies`` processes of each (named ``guard#i`` when more than one).  ``hold_to``: first hold
    anonymous memory in a process of the bench's own (SIGKILLed at the end) so that MemAvailable
    is near ``hold_to`` GiB, for a run whose MemAvailable and lines are under 10^8 kB (95.4 GiB,
    the kernel's 8 columns) on a machine with more; refused unless ``hold_to`` is at least
    ``headroom`` + 8 GiB.

    Returns one row per process: CPU seconds (all threads), % of one core, scheduler runs
    (wake-ups) per second and CPU microseconds per wake-up, VmRSS at the end.

    Copies matter: on the GPU machine two processes running the very same floor loop in one run
    have differed by up to 1.4x in CPU per wake-up (where each lands, what shares its core), as
    much as a guard differs from the floor; :func:`idle_medians` compares medians of copies."""
    if hold_to is not None and hold_to < headroom + 8:
        raise SystemExit(f"--idle-hold {hold_to:g} GiB leaves less than --idle-headroom + 8 GiB")
    holder = None
    work = tempfile.mkdtemp(prefix="sg-h2h-idle-")
    nss = {}
    rows = []
    try:
        n = 0 if hold_to is None else int(mem_available() - hold_to * GiB)
        if n > 0:       # its parent-death signal: a SIGKILLed bench leaves no holder behind
            holder = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", sys.executable, "-c", HOLD_PY, str(n)],
                                      stdout=subprocess.PIPE, text=True)
            if holder.stdout.readline().strip() != "held":
                raise SystemExit("--idle-hold: the holding process did not start")
            print(f"holding {n / GiB:.1f} GiB: MemAvailable {mem_available() / GiB:.1f} GiB", flush=True)
        term = max(GiB, int(mem_available() - headroom * GiB))
        def named(g: str, i: int) -> str:
            return g if copies == 1 else f"{g}#{i}"

        for i in range(copies):
            for g in guards:
                d = os.path.join(work, named(g, i))
                os.mkdir(d)
                argv, ready = guard_cmd(g, term, term - GiB, "sgidle" + uuid.uuid4().hex[:8], d)
                nss[named(g, i)] = (Namespace(argv, None, os.path.join(d, "log")), ready)
        for name, argv in (floor_cmds(work, term) if floors else {}).items():
            for i in range(copies):
                nss[named(name, i)] = (Namespace(argv, None, os.path.join(work, named(name, i) + ".log")), "ready")
        pids = {}
        for g, (ns, ready) in nss.items():
            if not ns.wait_log(ready, 20):
                print(f"   {g} did not start for the idle run")
                continue
            pids[g] = guard_pid(ns, g.split("#")[0])
        print(f"idle: {', '.join(pids) or 'no guard'} side by side for {seconds:g} s", flush=True)
        time.sleep(2)
        c0 = {g: proc_cpu(p) for g, p in pids.items() if p}
        t0 = time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        for g, p in pids.items():
            if not p:
                continue
            cpu, runs = proc_cpu(p)
            cpu -= c0[g][0]
            runs = None if runs is None else runs - c0[g][1]
            rows.append({"guard": g, "idle_cpu_s": round(cpu, 4), "idle_seconds": round(dt, 1),
                         "idle_cpu_pct_core": round(cpu / dt * 100, 4),
                         "wakeups_per_s": None if runs is None else round(runs / dt, 2),
                         "us_per_wakeup": round(cpu / runs * 1e6, 1) if runs else None,
                         "rss_mib": round(proc_rss(p) / MiB, 1)})
    finally:
        for ns, _ in nss.values():
            ns.close()
        subprocess.run(["rm", "-rf", work])
        if holder is not None:
            holder.kill()
            holder.wait()
    return rows


#: wake-ups per second above which a sparkguard of the idle run was not idling on its fast path:
#: 5 polls, 0.5 reads of the NVML thread (sparkguard/gpumem.py, where nvidia-ml-py is installed),
#: some slack; the GPU machine showed 6.2-7.6 when ~100 guard processes (30-65 MiB each, mlocked)
#: had taken most of the 8 GiB headroom and the full pass polled faster
IDLE_WAKEUPS_MAX = 5.7


def idle_medians(rows: list[dict], floor_name: str = "floor_python"
                 ) -> list[tuple[str, int, float, float, float, float | None]]:
    """Per guard (copies merged): ``(guard, copies, median, min, max, ratio)`` of CPU us per
    wake-up, the ratio being the median's to ``floor_name``'s median (None without that floor)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.get("us_per_wakeup") is not None:
            by.setdefault(r["guard"].split("#")[0], []).append(r["us_per_wakeup"])
    floor = statistics.median(by[floor_name]) if by.get(floor_name) else None
    return [(g, len(v), statistics.median(v), min(v), max(v),
             statistics.median(v) / floor if floor else None) for g, v in by.items()]


# ---------------------------------------------------------------- summary


def med_spread(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    m = statistics.median(vals)
    return f"{m:.1f} ({min(vals):.1f}-{max(vals):.1f})" if len(vals) > 1 else f"{m:.1f}"


def summarize(rows: list[dict]) -> str:
    """The markdown table: medians (min-max) per scenario, fill, guard and, where trials differ in
    them, bystanders, spinners and the guard's scheduling."""
    extra = [c for c in ("bystanders", "spinners", "sched")
             if any(r.get(c) not in (None, 0, "default") for r in rows)]

    def key(r):
        return (r["scenario"], r["tier"], r["guard"]) + tuple(r.get(c) for c in extra)

    keys = []
    for r in rows:
        if key(r) not in keys:
            keys.append(key(r))
    out = ["| scenario | fill | guard | " + "".join(f"{c} | " for c in extra) + "fill GiB/s | crossing->SIGTERM ms "
           "| overshoot MiB | SIGTERM->gone ms | memory back after crossing ms | hog stopped | kernel OOM kills |",
           "|---|---|---|" + "---|" * len(extra) + "---|---|---|---|---|---|---|"]
    for k in keys:
        rs = [r for r in rows if key(r) == k]
        ok = [r for r in rs if not r.get("error") or r.get("crossed")]
        stopped = sum(1 for r in rs if r.get("stopped"))
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | " + "".join(f"{v} | " for v in k[3:])
                   + f"{med_spread([r.get('fill_gib_s') for r in ok])} "
                   f"| {med_spread([r.get('term_latency_ms') for r in ok])} "
                   f"| {med_spread([r.get('overshoot_mib') for r in ok])} "
                   f"| {med_spread([r.get('term_to_exit_ms') for r in ok])} "
                   f"| {med_spread([r.get('back_after_cross_ms') for r in ok])} "
                   f"| {stopped}/{len(rs)} | {sum(r.get('oom_kills') or 0 for r in rs)} |")
    return "\n".join(out)


def summarize_shaped(rows: list[dict]) -> str:
    """The markdown table of the step and loadserve scenarios: per scenario and guard, how often the
    line was crossed at all, crossing->SIGTERM and overshoot over the trials that crossed, SIGTERMs
    before the crossing (the rate trigger acting early), false SIGTERMs (during a load that stopped
    above the line), the hog stopped, kernel OOM kills."""
    keys = []
    for r in rows:
        if (r["scenario"], r["guard"]) not in keys:
            keys.append((r["scenario"], r["guard"]))
    out = ["| scenario | guard | crossed | crossing->SIGTERM ms | overshoot MiB | SIGTERM before the crossing "
           "| false SIGTERMs (during the load) | hog stopped | kernel OOM kills |",
           "|---|---|---|---|---|---|---|---|---|"]
    for sc, g in keys:
        rs = [r for r in rows if (r["scenario"], r["guard"]) == (sc, g)]
        ok = [r for r in rs if r.get("crossed")]
        n = len(rs)
        out.append(f"| {sc} | {g} | {len(ok)}/{n} | {med_spread([r.get('term_latency_ms') for r in ok])} "
                   f"| {med_spread([r.get('overshoot_mib') for r in ok])} "
                   f"| {sum(1 for r in rs if r.get('term_before_cross'))}/{n} "
                   f"| {sum(1 for r in rs if r.get('false_term')) if sc == 'loadserve' else '-'}"
                   f"{'/' + str(n) if sc == 'loadserve' else ''} "
                   f"| {sum(1 for r in rs if r.get('stopped'))}/{n} | {sum(r.get('oom_kills') or 0 for r in rs)} |")
    return "\n".join(out)


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: unwind through every ``finally`` (namespaces closed)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> None:
    """SIGINT/SIGTERM/SIGHUP raise :class:`Stopped` once; later ones are ignored so the cleanup
    that follows (SIGKILL of each namespace, removal of work folders) is not cut short."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def handler(signum, frame):
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in sigs:
        signal.signal(s, handler)


def main() -> int:
    ap = argparse.ArgumentParser(description="sparkguard vs earlyoom vs nohang against the same hogs")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--only", default=",".join(GUARDS), help="comma-separated guards")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--bystanders", default="0", metavar="N[,N...]",
                    help="sleeping processes started in each trial's namespace before the guard, e.g. 0,5000 "
                         "(each count is a trial of its own; about 200 KiB each)")
    ap.add_argument("--spinners", default="0", metavar="N|Nx",
                    help="busy-looping processes in each trial's namespace (Nx: N per CPU), for CPU saturation")
    ap.add_argument("--sched", default="default", metavar="S[,S...]",
                    help=f"sparkguard's CPU scheduling, each a trial of its own: {', '.join(SCHED)}")
    ap.add_argument("--tree-procs", type=int, default=TREE_PROCS, help="processes of the tree scenario's hog")
    ap.add_argument("--headroom", type=float, default=1.25, help="GiB between MemAvailable now and the line")
    ap.add_argument("--step-gib", type=float, default=None,
                    help="step: GiB of the one allocation (default headroom + 0.75: it crosses the line)")
    ap.add_argument("--load-margin", type=float, default=0.35,
                    help="loadserve: GiB above the line where the load stops")
    ap.add_argument("--load-rate", type=float, default=2.0, help="loadserve: GiB/s of the load (capped by "
                    "what one thread fills here)")
    ap.add_argument("--leak-rate", type=float, default=0.3, help="loadserve: GiB/s of the serving leak after it")
    ap.add_argument("--trial-timeout", type=float, default=25.0, help="seconds before the bench ends a hog itself")
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--idle-copies", type=int, default=1, metavar="N",
                    help="N processes of each guard and floor in the idle run, compared by their medians")
    ap.add_argument("--idle-hold", type=float, default=None, metavar="GIB",
                    help="hold memory in a process of the bench's own so that MemAvailable is near GIB during "
                         "the idle run (at least --idle-headroom + 8): a run under 10^8 kB on a machine with more, "
                         "where the value fits the kernel's 8 columns")
    ap.add_argument("--idle-headroom", type=float, default=8.0, metavar="GIB",
                    help="GiB between MemAvailable at the idle run's start and the line (sparkguard's idle fast "
                         "path runs 6.4 GiB above it; each guard process of the run takes 30-65 MiB of it: "
                         "with many --idle-copies give 16 or more)")
    ap.add_argument("--no-idle", action="store_true")
    ap.add_argument("--idle-only", action="store_true", help="only the idle measurement")
    ap.add_argument("--no-floors", action="store_true",
                    help="idle without the floor loops (bare Python and C: read /proc/meminfo, sleep 200 ms)")
    ap.add_argument("--baseline", metavar="DIR", action="append", default=[],
                    help="also run the sparkguard of another checkout (e.g. `git worktree add /tmp/base HEAD~1`) "
                         "as guard sparkguard@base, side by side with this one in every trial and the idle run; "
                         "given again, each further one runs as sparkguard@DIRNAME")
    ap.add_argument("--csv", default="bench/headtohead.csv")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    if args.step_gib is None:
        args.step_gib = args.headroom + 0.75
    if args.step_gib > args.headroom + 1.5:
        print("headtohead: --step-gib must stay above the hog's cap (headroom + 1.5 GiB at most): one "
              "allocation cannot stop half way", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("headtohead: needs root (PID namespaces, earlyoom/nohang signalling)", file=sys.stderr)
        return 2
    guards = [g for g in args.only.split(",") if g]
    for i, base in enumerate(args.baseline):
        if not os.path.isfile(os.path.join(base, "sparkguard", "cli.py")):
            print(f"headtohead: --baseline {base}: no sparkguard/cli.py there", file=sys.stderr)
            return 2
        name = "sparkguard@base" if i == 0 else "sparkguard@" + os.path.basename(os.path.normpath(base))
        SOURCES[name] = os.path.abspath(base)
        guards.append(name)
    stop_on_signals()
    try:
        return bench(args, guards)
    except Stopped as e:      # before or after the trials (calibration, idle, summary)
        print(f"headtohead: stopped by {e}; every namespace was SIGKILLed", file=sys.stderr)
        return 128 + e.signum


def bench(args, guards: list[str]) -> int:
    """The trials, the idle run and the report; raises :class:`Stopped` on a signal outside the trials."""
    a0 = mem_available()
    if a0 < 8 * GiB:
        print(f"headtohead: only {a0 / GiB:.1f} GiB MemAvailable; need 8 GiB to run safely", file=sys.stderr)
        return 2
    rate1 = calibrate_one_thread()
    print(f"one thread fills {rate1 / GiB:.2f} GiB/s here; MemAvailable {a0 / GiB:.1f} GiB", flush=True)
    rows: list[dict] = []
    stopped: Stopped | None = None
    bystanders = [int(n) for n in args.bystanders.split(",") if n.strip()] or [0]
    scheds = [x for x in args.sched.split(",") if x] or ["default"]
    for x in scheds:
        if x not in SCHED:
            print(f"headtohead: --sched {x}: expected one of {', '.join(SCHED)}", file=sys.stderr)
            return 2
    try:
        for sc in ([] if args.idle_only else args.scenarios.split(",")):
            for tier in ([SHAPED[sc]] if sc in SHAPED else args.tiers.split(",")):
                for i in range(args.trials):
                    gs = [g for g in guards if g != PHASED or sc == "loadserve"]
                    order = gs[i % len(gs):] + gs[:i % len(gs)]
                    for g, nb, sch in ((g, nb, sch) for g in order for nb in bystanders
                                       for sch in (scheds if g in SOURCES else ["default"])):
                        settle(a0)
                        r = run_trial(g, sc, tier, args, rate1, nb, sch)
                        r["trial"] = i
                        rows.append(r)
                        print(f"{sc:6} {tier:8} #{i} {g:10} " + (f"bystanders {nb} " if nb else "") +
                              (f"{sch} " if sch != "default" else "") +
                              f"fill {r.get('fill_gib_s')} GiB/s "
                              f"term {r.get('term_latency_ms')} ms overshoot {r.get('overshoot_mib')} MiB "
                              f"gone {r.get('term_to_exit_ms')} ms back {r.get('back_after_cross_ms')} ms "
                              f"oom {r.get('oom_kills')} " +
                              (f"false_term {r.get('false_term')} load {r.get('load_s')} s " if sc == "loadserve" else "") +
                              (f"step {r.get('step_s')} s " if sc == "step" else "") + f"{r.get('error', '')}", flush=True)
    except Stopped as e:
        stopped = e
        print(f"headtohead: stopped by {e}; every namespace was SIGKILLed; summarising what ran", file=sys.stderr)
    idle_rows = [] if args.no_idle or stopped else idle(args.idle_seconds, guards, not args.no_floors,
                                                                  max(1, args.idle_copies), args.idle_headroom,
                                                                  args.idle_hold)
    fields = ["guard", "scenario", "tier", "bystanders", "spinners", "sched", "trial", "fill_gib_s", "crossed", "term_latency_ms", "overshoot_mib",
              "term_to_exit_ms", "end_after_cross_ms", "back_after_cross_ms", "oom_kills", "stopped", "escalated",
              "terms", "line_bytes", "false_term", "load_s", "step_s", "term_before_cross", "error"]
    if rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if any(r["scenario"] not in SHAPED for r in rows) or not rows:
        print()
        print(summarize([r for r in rows if r["scenario"] not in SHAPED]))
    if any(r["scenario"] in SHAPED for r in rows):
        print()
        print(summarize_shaped([r for r in rows if r["scenario"] in SHAPED]))
    if idle_rows:
        print()
        print(f"| guard | idle CPU s / {args.idle_seconds:.0f} s | % of one core | wake-ups/s | CPU us per wake-up "
              "| RSS MiB |")
        print("|---|---|---|---|---|---|")
        for r in idle_rows:
            print(f"| {r['guard']} | {r['idle_cpu_s']} | {r['idle_cpu_pct_core']} | {r['wakeups_per_s']} "
                  f"| {r['us_per_wakeup']} | {r['rss_mib']} |")
        print()
        print("| guard | copies | CPU us per wake-up, median (min-max) | median / floor_python's "
              "| median / floor_python_check's |")
        print("|---|---|---|---|---|")
        checked = {g: r for g, *_, r in idle_medians(idle_rows, "floor_python_check")}
        for g, n, med, lo, hi, ratio in idle_medians(idle_rows):
            r2 = checked.get(g)
            print(f"| {g} | {n} | {med:.1f} ({lo:.1f}-{hi:.1f}) | {'n/a' if ratio is None else f'{ratio:.2f}'} "
                  f"| {'n/a' if r2 is None else f'{r2:.2f}'} |")
        for r in idle_rows:
            if r["guard"].startswith("sparkguard") and (r["wakeups_per_s"] or 0) > IDLE_WAKEUPS_MAX:
                print(f"WARNING: {r['guard']} woke {r['wakeups_per_s']}/s, more than its 5 polls (+0.5 for "
                      f"NVML's reads every 2 s): it was not on its idle fast path; the guards' own memory "
                      f"took the headroom: raise --idle-headroom")
        with open(os.path.splitext(args.csv)[0] + "-idle.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(idle_rows[0]))
            w.writeheader()
            w.writerows(idle_rows)
    if stopped:
        return 128 + stopped.signum
    if "sparkguard" in guards:
        print(f"\nsparkguard per idle poll: {sparkguard_poll_cost():.2f} us (pread+parse /proc/meminfo, "
              "decision, next interval)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

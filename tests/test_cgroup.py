"""Each engine run in a cgroup of its own (sparkguard/supervisor/cgroup.py): readers on fixture
trees, then real cgroup2 cgroups on this machine (each made under a parent of the test's own,
removed in a finally) and a real ``sparkguard run`` whose engine double-forks and calls setsid."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import uuid

import pytest

from sparkguard import enginetree, proctree, signals
from sparkguard.guard import cgkill
from sparkguard.supervisor import cgroup, cgroup_delegation, process, tracking
from supervisor_helpers import Daemon, engine_config, kill_pids, unique

#: an engine whose grandchild leaves both its process group (setsid) and its parent chain
#: (double fork: reparented to init or a subreaper) and ignores SIGTERM; each line is one
#: write(2), so the two processes' lines never interleave (print writes the newline apart
#: when PYTHONUNBUFFERED is set)
ESCAPER = r"""
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(1, f"escaped pid={os.getpid()} pgrp={os.getpgrp()}\n".encode())
        while True:
            time.sleep(3600)
    os._exit(0)
os.wait()
os.write(1, f"root pid={os.getpid()} MARK\n".encode())
while True:
    time.sleep(3600)
"""


def escaper(mark: str) -> list[str]:
    return [sys.executable, "-c", ESCAPER.replace("MARK", mark)]


# ---- readers on fixture trees --------------------------------------------------------------

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE = """\
22 1 0:21 / /proc rw,nosuid - proc proc rw
30 24 0:26 / /srv/other\\040cg rw - cgroup2 cgroup2 rw
29 24 0:25 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""


def test_find_mount_prefers_sys_fs_cgroup_and_decodes_escapes(tmp_path):
    (tmp_path / "hybrid").write_text(HYBRID)
    (tmp_path / "pure").write_text(PURE)
    (tmp_path / "none").write_text(HYBRID.splitlines()[0] + "\n")
    (tmp_path / "only").write_text(PURE.splitlines()[1] + "\n")
    assert cgroup.find_mount(str(tmp_path / "hybrid")) == ("/sys/fs/cgroup/unified", "/")
    assert cgroup.find_mount(str(tmp_path / "pure")) == ("/sys/fs/cgroup", "/")
    assert cgroup.find_mount(str(tmp_path / "only")) == ("/srv/other cg", "/")
    assert cgroup.find_mount(str(tmp_path / "none")) is None
    assert cgroup.find_mount(str(tmp_path / "absent")) is None


def test_own_path_and_cgroup_dir(tmp_path):
    f = tmp_path / "cgroup"
    f.write_text("9:name=systemd:/\n4:memory:/x\n0::/system.slice/sparkguard.service\n")
    assert cgroup.own_path(str(f)) == "/system.slice/sparkguard.service"
    f.write_text("4:memory:/x\n")
    assert cgroup.own_path(str(f)) is None
    assert cgroup.cgroup_dir(("/sys/fs/cgroup", "/"), "/a.slice/b.service") == "/sys/fs/cgroup/a.slice/b.service"
    assert cgroup.cgroup_dir(("/sys/fs/cgroup/unified", "/"), "/") == "/sys/fs/cgroup/unified"
    # a mount of a sub-tree (a container's cgroup namespace seen from outside): paths below its root
    assert cgroup.cgroup_dir(("/mnt/cg", "/machine.slice/c"), "/machine.slice/c/x") == "/mnt/cg/x"


def fake_cgroup(path, pids=(), populated=None):
    """A directory shaped like a cgroup2 one (cgroup.procs, cgroup.events)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    pop = bool(pids) if populated is None else populated
    (path / "cgroup.events").write_text(f"populated {int(pop)}\nfrozen 0\n")
    return path


def test_members_walk_nested_cgroups_and_events_read(tmp_path):
    top = fake_cgroup(tmp_path / "engine-1.000", [10, 11], populated=True)
    fake_cgroup(top / "a", [12])
    fake_cgroup(top / "a" / "b", [13, 10])
    fake_cgroup(top / "empty")
    assert cgroup.members(str(top)) == [10, 11, 12, 13]
    assert cgroup.procs(str(top)) == [10, 11]
    assert cgroup.populated(str(top)) is True
    assert cgroup.populated(str(top / "empty")) is False
    assert cgroup.populated(str(tmp_path / "gone")) is None
    assert cgroup.members(str(tmp_path / "gone")) == []
    assert cgroup.wait_empty(str(top / "empty"), 0.0) is True


def test_place_falls_back_to_process_group_and_says_why(tmp_path):
    mi, pc = tmp_path / "mountinfo", tmp_path / "cgroup"
    mi.write_text(HYBRID.splitlines()[0] + "\n")
    pc.write_text("0::/\n")
    p = cgroup.place(str(mi), str(pc), env={})
    assert (p.mode, p.parent) == (cgroup.PGROUP, None) and "no cgroup2" in p.reason
    # a cgroup2 mount whose tree is a plain directory (read-only, not cgroupfs): not usable
    root = tmp_path / "cg"
    root.mkdir()
    mi.write_text(f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n")
    pc.write_text("0::/\n")
    p = cgroup.place(str(mi), str(pc), env={})
    assert p.mode == cgroup.PGROUP and "not a cgroup2 directory" in p.reason
    # under a systemd unit that does not delegate (no trusted.delegate xattr): left to systemd
    fake_cgroup(root / "system.slice" / "sparkguard.service", [os.getpid()])
    pc.write_text("0::/system.slice/sparkguard.service\n")
    p = cgroup.place(str(mi), str(pc), env={})
    assert p.mode == cgroup.PGROUP and "Delegate=yes" in p.reason and "sparkguard.service" in p.reason
    # forced off, or forced to a directory that is not a cgroup
    assert cgroup.place(str(mi), str(pc), env={cgroup.ENV_PARENT: "none"}).mode == cgroup.PGROUP
    p = cgroup.place(str(mi), str(pc), env={cgroup.ENV_PARENT: str(tmp_path)})
    assert p.mode == cgroup.PGROUP and "not a cgroup2 directory" in p.reason
    assert cgroup.describe(p).startswith("process group (")


# ---- real cgroups --------------------------------------------------------------------------

def _real_parent() -> str | None:
    mount = cgroup.find_mount()
    path = cgroup.own_path()
    if mount is None or path is None or os.geteuid() != 0:
        return None
    here = cgroup.cgroup_dir(mount, path)
    return here if cgroup._writable(here) is None else None


@pytest.fixture
def cg_parent():
    """A cgroup of this test's own under this process's cgroup; every process left in it is
    killed (only processes this test started can be there) and every cgroup below removed."""
    here = _real_parent()
    if here is None:
        pytest.skip("no writable cgroup2 here (needs root and a cgroup2 mount)")
    path = os.path.join(here, f"sgtest-{uuid.uuid4().hex[:10]}")
    os.mkdir(path)
    try:
        yield path
    finally:
        if os.path.isfile(os.path.join(path, "cgroup.kill")):
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
        cgroup.wait_empty(path, 10.0)
        for d, _, _ in os.walk(path, topdown=False):
            os.rmdir(d)


def _pidfd_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (pidfd readable within ``timeout`` s); a pid already gone counts."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _spawn_escaper(cg):
    """process.spawn of the escaper into ``cg``; returns (proc, escaped pid, its start time)."""
    proc = process.spawn(escaper("up"), dict(os.environ), None, None, cgroup=cg)
    lines = {}
    while len(lines) < 2:
        if not select.select([proc.stdout.raw], [], [], 10.0)[0]:
            raise AssertionError(f"the engine printed no line for 10 s (seen: {lines})")
        line = proc.stdout.raw.readline().decode()
        assert line, "the engine exited early"
        m = re.match(r"(escaped|root) pid=(\d+)", line)
        if m:
            lines[m.group(1)] = int(m.group(2))
    esc = lines["escaped"]
    return proc, esc, proctree.read_proc(esc).starttime


def _reap(proc):
    for s in (proc.stdout, proc.stderr):
        s.close()
    proc.wait(10)


def test_the_engine_is_in_its_cgroup_before_it_runs_and_an_escaped_child_stays_a_member(cg_parent):
    pl = cgroup.Placement(cgroup.CGROUP, cg_parent, "test")
    cg = cgroup.EngineCgroup.create(pl, 1234.5)
    assert cg.path == os.path.join(cg_parent, "engine-1234.500")
    assert cgroup.EngineCgroup.create(pl, 1234.5).path.endswith("engine-1234.500-2")   # a name taken
    proc, esc, st = _spawn_escaper(cg)
    try:
        assert cg.entered
        p = proctree.read_proc(esc)
        assert p.pgrp != proc.pid and p.ppid != proc.pid       # out of the process group and the chain
        assert esc not in proctree.descendants([proc.pid], proctree.children_map(proctree.scan()))
        assert sorted(cg.pids()) == sorted([proc.pid, esc])
        assert open(f"/proc/{esc}/cgroup").read().strip().endswith("/engine-1234.500")
        assert cg.populated() is True
        assert cg.wait_empty(0.2) is False                      # bounded: still populated
        assert cg.kill()                                        # one write: the whole cgroup
        assert cg.wait_empty(10.0), "cgroup.events never said populated 0"
        assert _pidfd_gone(esc, 5.0)
        assert cg.pids() == []
    finally:
        kill_pids({esc: st})
        _reap(proc)
    assert cg.remove() and not os.path.exists(cg.path)


@pytest.mark.parametrize("has_kill", [True, False], ids=["cgroup.kill", "pidfd-fallback"])
def test_the_tree_sigkill_reaches_the_escaped_child(cg_parent, has_kill):
    """The guard's target and process.signal_tree of a run with a cgroup hold the escaped
    grandchild; SIGTERM the root, then the tree's SIGKILL kills the grandchild (which ignores
    SIGTERM), by cgroup.kill or by a pidfd per member."""
    cg = cgroup.EngineCgroup.create(cgroup.Placement(cgroup.CGROUP, cg_parent, "test"), 7.0)
    cg.has_kill = has_kill and cg.has_kill
    proc, esc, st = _spawn_escaper(cg)

    class R:           # the fields of supervisor.run.Run that process.target / signal_tree read
        pid = pgid = proc.pid
        starttime = proctree.read_proc(proc.pid).starttime
        members = {proc.pid: starttime}
        cgroup = cg
        container = None       # not a docker run engine
    try:
        # the memory guard's view of the supervised engine (Supervisor.target) has it too
        t = process.target(R, proctree.scan(), enginetree.Protector([]))
        assert t is not None and esc in t.pids, t
        tree = process.signal_tree(R)
        assert isinstance(tree, cgroup.CgroupTree) and esc in tree.fds
        tree.term_root()
        assert _pidfd_gone(proc.pid, 5.0)
        assert not _pidfd_gone(esc, 0.3)                        # ignored SIGTERM, still running
        killed = tree.kill_all()
        assert esc in killed
        assert cg.wait_empty(10.0) and _pidfd_gone(esc, 5.0)
        tree.close()
    finally:
        kill_pids({esc: st})
        _reap(proc)
    assert cg.remove()


def test_cgroup_kill_does_not_count_members_outside_the_cgroup_as_killed(cg_parent):
    """A container engine's tree holds processes of another cgroup (docker's) beside the run
    cgroup's: after the cgroup.kill write those still get their SIGKILL by pidfd."""
    cg = cgroup.EngineCgroup.create(cgroup.Placement(cgroup.CGROUP, cg_parent, "test"), 9.0)
    proc, esc, st = _spawn_escaper(cg)
    outside = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
    try:
        if not cg.has_kill:
            pytest.skip("no cgroup.kill here (Linux < 5.14)")
        starts = {p: proctree.read_proc(p).starttime for p in (proc.pid, outside.pid)}
        tree = cgroup.CgroupTree([proc.pid, outside.pid], starts, cg)
        killed = tree.kill_all()
        assert outside.pid in killed
        assert outside.wait(timeout=5) == -signal.SIGKILL
        assert cg.wait_empty(10.0)
        tree.close()
    finally:
        if outside.poll() is None:
            outside.kill()
            outside.wait()
        kill_pids({esc: st})
        _reap(proc)
    assert cg.remove()


def test_the_sweep_finds_cgroup_members_and_waits_for_the_cgroup_to_empty(cg_parent):
    cg = cgroup.EngineCgroup.create(cgroup.Placement(cgroup.CGROUP, cg_parent, "test"), 8.0)
    proc, esc, st = _spawn_escaper(cg)
    notes = []
    try:
        os.kill(proc.pid, signal.SIGKILL)       # our own child
        assert _pidfd_gone(proc.pid, 5.0)
        # without the cgroup the escaped child is nobody's: not in the group, not recorded
        assert esc not in process.leftovers(proc.pid, {}, exclude=proc.pid)
        assert esc in process.leftovers(proc.pid, {}, exclude=proc.pid, cgroup=cg)
        found = process.sweep(proc.pid, {}, 0.5, [], lambda ev, d: notes.append(d), exclude=proc.pid, cgroup=cg)
        assert found == [esc]
        assert cg.populated() is False and _pidfd_gone(esc, 1.0)
        assert any("SIGKILL 1 leftovers" in n for n in notes), notes
    finally:
        kill_pids({esc: st})
        _reap(proc)
    assert cg.remove()


# ---- the supervisor, a real daemon -------------------------------------------------------------

def _daemon(tmp_path, monkeypatch, parent: str, model: str) -> Daemon:
    monkeypatch.setenv(cgroup.ENV_PARENT, parent)
    cfg = engine_config(tmp_path, model, escaper(model), None)
    cfg["guard"]["grace"] = "1s"
    return Daemon(tmp_path, cfg)


def test_a_supervised_engine_in_its_cgroup_is_stopped_whole(tmp_path, monkeypatch, cg_parent):
    """`sparkguard run` with the engine in a cgroup: status and the start line say so, `engine
    stop` SIGTERMs the root, the sweep finds the setsid'd, reparented grandchild by its cgroup and
    SIGKILLs it after the grace; the run's cgroup is removed."""
    model = unique("sgcg")
    d = _daemon(tmp_path, monkeypatch, cg_parent, model)
    esc = {}
    try:
        d.wait_control()
        m = d.wait_line(r"escaped pid=(\d+)")
        pid = int(m.group(1))
        esc[pid] = proctree.read_proc(pid).starttime
        st = d.wait_ready()
        assert st["tracking"]["mode"] == "cgroup"
        cg = st["tracking"]["cgroup"]
        assert cg and os.path.dirname(cg) == cg_parent and os.path.basename(cg) == f"engine-{st['run_start']:.3f}"
        assert pid in cgroup.members(cg)
        d.wait_line(r"start: pid \d+, tracked by cgroup " + re.escape(cg))
        out = subprocess.run([sys.executable, "-m", "sparkguard", "engine", "status", "--socket", d.socket],
                             capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(
                                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
        assert f"tracking: cgroup {cg}" in out.stdout, out.stdout + out.stderr
        assert d.ctl("stop")["ok"]
        d.wait_line(r"sweep: 1 leftover processes of the engine: " + str(pid), 30)
        d.wait_line(r"SIGKILL 1 leftovers still alive after 1 s", 30)
        assert _pidfd_gone(pid, 10.0)
        d.wait_line(r"exit: pid \d+ .*swept 1 leftover", 30)
        assert not os.path.exists(cg)
    finally:
        d.cleanup()
        kill_pids(esc)


def test_without_a_usable_cgroup_the_supervisor_says_process_group(tmp_path, monkeypatch):
    model = unique("sgcg")
    d = _daemon(tmp_path, monkeypatch, str(tmp_path), model)
    esc = {}
    try:
        d.wait_control()
        m = d.wait_line(r"escaped pid=(\d+)")
        esc[int(m.group(1))] = proctree.read_proc(int(m.group(1))).starttime
        st = d.wait_ready()
        assert st["tracking"]["mode"] == "process-group" and st["tracking"]["cgroup"] is None
        assert "not a cgroup2 directory" in st["tracking"]["detail"]
        d.wait_line(r"engine: tracked by process group \(" + re.escape(str(tmp_path)))
        d.wait_line(r"start: pid \d+, tracked by process group")
    finally:
        d.cleanup()
        kill_pids(esc)


def test_an_engine_of_another_user_is_moved_in_by_the_daemon(cg_parent):
    """engine.user: the engine could not move itself (it may not write the daemon's cgroup), so
    the daemon moves it while sh waits for its "go" line; it runs as that user, in the cgroup."""
    cg = cgroup.EngineCgroup.create(cgroup.Placement(cgroup.CGROUP, cg_parent, "test"), 9.0)
    proc = process.spawn(["/bin/sh", "-c", "echo in; exec sleep 30"], {"PATH": "/usr/bin:/bin"}, "/", "nobody",
                         cgroup=cg)
    try:
        assert select.select([proc.stdout.raw], [], [], 10.0)[0] and proc.stdout.raw.readline() == b"in\n"
        assert cg.entered and cg.pids() == [proc.pid]
        uid = next(ln.split()[1] for ln in open(f"/proc/{proc.pid}/status") if ln.startswith("Uid:"))
        assert int(uid) == process.passwd("nobody").pw_uid
        assert cg.kill() and cg.wait_empty(10.0)
    finally:
        kill_pids({proc.pid: proctree.read_proc(proc.pid).starttime} if proctree.read_proc(proc.pid) else {})
        _reap(proc)
    assert cg.remove()


def test_place_under_a_delegated_systemd_unit_and_after_the_move(tmp_path):
    """A unit cgroup systemd marked delegated (trusted.delegate, module doc) is the parent, also
    once the daemon runs in its guard/ leaf; describe() of a run without a cgroup says process group."""
    root = tmp_path / "cg"
    unit = fake_cgroup(root / "system.slice" / "sparkguard.service", [os.getpid()])
    (root / "cgroup.procs").write_text("")
    (root / "cgroup.max.depth").write_text("max\n")
    try:
        os.setxattr(unit, "trusted.delegate", b"1")
    except OSError as e:
        pytest.skip(f"no trusted.* xattrs on {tmp_path}: {e}")
    mi, pc = tmp_path / "mountinfo", tmp_path / "cgroup"
    mi.write_text(f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n")
    for own in ("/system.slice/sparkguard.service", "/system.slice/sparkguard.service/guard"):
        pc.write_text(f"0::{own}\n")
        p = cgroup.place(str(mi), str(pc), env={}, move_self=False)
        assert (p.mode, p.parent) == (cgroup.CGROUP, str(unit)), p
        assert "delegated by systemd unit sparkguard.service" in p.reason
    assert cgroup.describe(p).startswith(f"cgroup under {unit} (")
    assert cgroup.describe(p, run=True).startswith("process group (its cgroup under")


def test_remove_stale_takes_only_old_empty_engine_cgroups(cg_parent):
    """Old and empty: removed.  Populated (a live engine), young (another daemon's start) or
    not an engine's: kept."""
    for name in ("engine-100.000", "engine-100.000-2", "engine-200.000", "engine-5000.000", "other"):
        os.mkdir(os.path.join(cg_parent, name))
    busy = cgroup.EngineCgroup(os.path.join(cg_parent, "engine-200.000"))
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert busy.enter(proc.pid)
        got = cgroup.remove_stale(cg_parent, 1000.0)
        assert sorted(os.path.basename(p) for p in got) == ["engine-100.000", "engine-100.000-2"]
        left = {e.name for e in os.scandir(cg_parent) if e.is_dir()}
        assert left == {"engine-200.000", "engine-5000.000", "other"}, left
        assert os.path.isdir(busy.path)
    finally:
        proc.kill()
        proc.wait(10)


def test_delegation_unreadable_falls_back_to_a_write_test_under_the_units_cgroup(tmp_path, cg_parent):
    """systemd < 251 sets only trusted.delegate, which reads as absent without CAP_SYS_ADMIN (the
    shipped unit's capability set): then a probe cgroup made and removed under the unit's (real)
    cgroup decides, and the placement says so; where the xattr's absence is conclusive (CAP_SYS_ADMIN
    held, or systemd >= 251, which also sets user.delegate) there is no write test."""
    unit = os.path.join(cg_parent, "sparkguard.service")
    os.mkdir(unit)
    point, _ = cgroup.find_mount()
    pc = tmp_path / "cgroup"
    pc.write_text(f"0::/{os.path.relpath(unit, point)}\n")

    def place(**detect):
        return cgroup.place("/proc/self/mountinfo", str(pc), env={}, move_self=False, **detect)
    p = place(cap_sys_admin=False, version=249)
    assert (p.mode, p.parent, p.delegation) == (cgroup.CGROUP, unit, "write-test"), p
    assert "systemd 249 < 251" in p.reason and "write test (mkdir/rmdir of a probe cgroup) passed" in p.reason
    assert [e.name for e in os.scandir(unit) if e.is_dir()] == [], "the probe cgroup was left behind"
    assert "[delegation: write test]" in tracking.status(p, None)["detail"]
    p = place(cap_sys_admin=False, version=lambda: None)  # systemctl not there: the write test too
    assert p.delegation == "write-test" and "systemd of unknown version" in p.reason
    # the write test fails: no cgroup may be made below (cgroup.max.descendants 0: mkdir says EAGAIN)
    with open(os.path.join(unit, "cgroup.max.descendants"), "w") as f:
        f.write("0")
    p = place(cap_sys_admin=False, version=249)
    assert (p.mode, p.delegation) == (cgroup.PGROUP, "write-test") and "the write test failed" in p.reason, p
    assert "Delegate=yes" in p.reason
    # conclusive absence: no write test
    p = place(cap_sys_admin=False, version=252)
    assert (p.mode, p.delegation) == (cgroup.PGROUP, "xattr") and "no user.delegate xattr (systemd 252" in p.reason
    p = place(cap_sys_admin=True, version=249)
    assert p.mode == cgroup.PGROUP and "readable: the daemon holds CAP_SYS_ADMIN" in p.reason
    st = tracking.status(p, None)
    assert st["delegation"] == "xattr" and st["why"] == p.reason and st["tracks"] == "engine"


def test_cap_sys_admin_and_the_systemd_version_are_read(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000200000\n")     # bit 21 only
    assert cgroup_delegation.has_cap_sys_admin(str(status))
    status.write_text("Name:\tx\nCapEff:\t00000000001fffff\n")     # bits 0-20
    assert not cgroup_delegation.has_cap_sys_admin(str(status))
    v = cgroup_delegation.systemd_version()
    assert v is None or v > 200


ESCAPE_ON_LINE = """
import os, sys, time
sys.stdin.readline()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(1, f"escaped pid={os.getpid()}\\n".encode())
        time.sleep(120)
    os._exit(0)
os.write(1, b"root\\n")
time.sleep(120)
"""


def _escaping_tree(cg_parent, name):
    """A root in a cgroup of its own that, on a line on stdin, double-forks a setsid'd grandchild
    (reparented away from the root: no descendant of it).  Returns ``(proc, cgroup dir)``."""
    cg = cgroup.EngineCgroup.create(cgroup.Placement(cgroup.CGROUP, cg_parent, "test"), name)
    proc = subprocess.Popen([sys.executable, "-c", ESCAPE_ON_LINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert cg.enter(proc.pid)
    return proc, cg


@pytest.mark.parametrize("use_kill", [True, False], ids=["cgroup.kill", "freeze"])
def test_the_guards_sigkill_of_a_cgroup_tree_reaches_what_escaped_the_tree(cg_parent, use_kill):
    """The guard chose the tree (its pidfds) before a member double-forked away: a plain pidfd
    tree misses the escaper; the cgroup's tree (guard.cgkill, what the guard uses for a target
    that names cgroups) kills it: cgroup.kill, or freeze + pidfd SIGKILL + thaw."""
    proc, cg = _escaping_tree(cg_parent, 11.0 if use_kill else 12.0)
    esc = {}
    try:
        st = {proc.pid: proctree.read_proc(proc.pid).starttime}
        target = enginetree.Target(proc.pid, "t", "t", [proc.pid], dict(st), cgroups=[cg.path])
        plain = signals.Tree([proc.pid], dict(st))
        tree = cgkill.CgroupsTree(target.pids, target.starttimes, target.cgroups, root=proc.pid, use_kill=use_kill)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        pid = int(next(ln for ln in lines if ln.startswith(b"escaped")).split(b"=")[1])
        esc[pid] = proctree.read_proc(pid).starttime
        assert pid in cg.pids() and pid not in tree.fds
        try:
            assert plain.kill_all() == [proc.pid] and proc.wait(10) == -signal.SIGKILL
            assert _pidfd_gone(pid, 0.5) is False, "the plain pidfd tree was to miss the escaper"
            killed = tree.kill_all()
            assert pid in killed and _pidfd_gone(pid, 10.0)
            assert tree.how == ("cgroup.kill" if use_kill and cg.has_kill else "freeze"), tree.how
            assert cg.wait_empty(10.0) and cgroup.events(cg.path).get("frozen", 0) == 0
        finally:
            plain.close()
            tree.close()
        assert isinstance(cgkill.tree_for(target), cgkill.CgroupsTree)
        target.cgroups = []
        assert type(cgkill.tree_for(target)) is signals.Tree
    finally:
        kill_pids(esc)
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()
        proc.stdout.close()
        proc.wait(10)
        cg.remove()

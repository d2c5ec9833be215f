"""Boot the test image under QEMU and drive it through the agent's virtio-serial port.

:class:`VM` starts ``qemu-system-x86_64`` on an image of :mod:`vm.image` (read-only: every write
of the guest goes to QEMU's temporary snapshot, ``snapshot=on``, kept across guest reboots and
dropped when QEMU exits), with no network device, no display, the guest's serial console in a
file, the agent's port as a unix socket and a QMP socket.  Commands run inside through the
agent (``tests/vm/agent.py``, protocol in its docstring); :meth:`VM.reboot` is a real guest
reboot (``systemctl reboot``: firmware, kernel, initramfs and systemd again), told apart from
the previous boot by the kernel's boot id.

Acceleration: TCG (software emulation) unless ``SPARKGUARD_TEST_VM_ACCEL=kvm``.  On the
development machines /dev/kvm exists but a KVM guest hung at boot (nested virtualization;
issue 19), while Debian's kernel boots under TCG.

A test run killed outright cannot run its own teardown: every VM records its owner and QEMU's
PID in ``CACHE_DIR/sgvm-*/owner``, and :func:`reap_stale` kills the QEMU of a dead owner (only a
process whose command line names that VM's own directory: never a process this module did not
start) and removes the directory.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from system import nspawn

QEMU = "qemu-system-x86_64"
#: Guest RAM in MiB.  The brief for the VM tests caps it at 3 GiB (the test machines have 24 GiB
#: shared by several engineers); 2 GiB leaves the memory tests room and fills fast under TCG.
MEMORY_MIB = int(os.environ.get("SPARKGUARD_TEST_VM_MEMORY_MIB", "2048"))
CPUS = int(os.environ.get("SPARKGUARD_TEST_VM_CPUS", "2"))
ACCEL = os.environ.get("SPARKGUARD_TEST_VM_ACCEL", "tcg")
PORT_NAME = "org.sparkguard.test.agent"
#: Kernel command line: the root file system is the whole virtio disk (no partition table), the
#: console the first serial port.
APPEND = "root=/dev/vda rw console=ttyS0,115200 loglevel=4 mitigations=off"


class Result:
    """A command's outcome inside the VM: ``returncode``, ``stdout``, ``stderr`` (text), ``timed_out``."""

    def __init__(self, argv: list[str], answer: dict):
        self.args = argv
        self.returncode = int(answer.get("rc", 255))
        self.stdout = answer.get("stdout", "")
        self.stderr = answer.get("stderr", "")
        self.timed_out = bool(answer.get("timeout"))

    def __repr__(self) -> str:
        return f"Result({self.args!r}, rc={self.returncode})"


def unavailable_reason() -> str | None:
    """Why a VM cannot be built and booted here, or None: not root, or a tool missing."""
    if os.geteuid() != 0:
        return "needs root (debootstrap and systemd-nspawn build the image)"
    for tool, pkg in ((QEMU, "qemu-system-x86"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} not found (tests/install-deps installs {pkg})"
    if ACCEL == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "SPARKGUARD_TEST_VM_ACCEL=kvm but /dev/kvm cannot be opened"
    return nspawn.unavailable_reason()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def reap_stale() -> list[str]:
    """Kill the QEMU of VMs whose test process is gone and remove their directories; returns their names."""
    reaped = []
    for d in sorted(nspawn.CACHE_DIR.glob("sgvm-*")):
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            if time.time() - d.stat().st_mtime < 600:
                continue  # being set up right now
            owner = {}
        pid = owner.get("pid")
        if pid and nspawn._starttime(pid) is not None and nspawn._starttime(pid) == owner.get("starttime"):
            continue  # its test run is alive
        qpid = owner.get("qemu")
        if qpid and str(d) in _cmdline(qpid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(qpid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while str(d) in _cmdline(qpid) and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(d, ignore_errors=True)
        reaped.append(d.name)
    return reaped


class VM:
    """One QEMU guest booted from a cached image directory (see :mod:`vm.image`).

    Lifecycle: ``VM(image_dir)``, :meth:`start` (QEMU up, agent connected, first boot complete),
    :meth:`run` / :meth:`sh` / :meth:`put` inside, :meth:`reboot`, :meth:`reset` (QMP
    ``system_reset``), :meth:`close` (idempotent;
    powers the guest off, kills QEMU by its PID if it does not exit, removes the directory).

    Attributes:
        dir: Path, the VM's own directory under CACHE_DIR (sockets, console log, snapshot file).
        console_log: Path of the guest's serial console output.
        boot_id: str, the kernel boot id of the current boot (after :meth:`start`).
        boot_seconds: list of float, wall seconds from QEMU start / reboot request to a
            ``running`` (or ``degraded``) system, one per boot.
    """

    def __init__(self, image_dir: Path, memory_mib: int = MEMORY_MIB, cpus: int = CPUS, accel: str = ACCEL):
        self.image = Path(image_dir)
        self.memory_mib, self.cpus, self.accel = memory_mib, cpus, accel
        nspawn.CACHE_DIR.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="sgvm-", dir=nspawn.CACHE_DIR))
        self.console_log = self.dir / "console.log"
        self.agent_sock = self.dir / "agent.sock"
        self.qmp_sock = self.dir / "qmp.sock"
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.boot_id: str | None = None
        self.boot_seconds: list[float] = []
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self._answers: dict[int, dict] = {}
        self._hellos: list[str] = []
        self._next_id = 1
        self._reader: threading.Thread | None = None
        self._write_owner()

    def _write_owner(self) -> None:
        (self.dir / "owner").write_text(json.dumps({
            "pid": os.getpid(), "starttime": nspawn._starttime(os.getpid()),
            "qemu": self.proc.pid if self.proc else None}))

    def argv(self) -> list[str]:
        """QEMU's command line for this VM."""
        accel = ["-accel", "kvm", "-cpu", "host"] if self.accel == "kvm" else ["-accel", "tcg", "-cpu", "max"]
        return [QEMU, *accel, "-m", str(self.memory_mib), "-smp", str(self.cpus),
                "-nodefaults", "-no-user-config", "-display", "none",
                "-name", "sparkguard-test",
                "-kernel", str(self.image / "vmlinuz"), "-initrd", str(self.image / "initrd.img"),
                "-append", APPEND,
                "-drive", f"file={self.image / 'disk.raw'},format=raw,if=virtio,snapshot=on,cache=unsafe",
                "-serial", f"file:{self.console_log}",
                "-device", "virtio-rng-pci",
                "-device", "virtio-serial-pci",
                "-chardev", f"socket,id=agent,path={self.agent_sock},server=on,wait=off",
                "-device", f"virtserialport,chardev=agent,name={PORT_NAME}",
                "-qmp", f"unix:{self.qmp_sock},server=on,wait=off"]

    # -- start and boot

    def start(self, timeout: float = 600) -> None:
        """Start QEMU and wait for the first boot to complete.

        Raises:
            QemuFailed: QEMU exited before the guest's agent said hello (its stderr in the message).
            AssertionError: no boot within ``timeout`` seconds (console tail in the message).
        """
        t0 = time.monotonic()
        # TMPDIR: QEMU puts the snapshot=on overlay there (block.c, bdrv_append_temp_snapshot).
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "qemu.stderr", "wb"),
                                     env=dict(os.environ, TMPDIR=str(self.dir)), start_new_session=True)
        self._write_owner()
        deadline = t0 + 30
        while not self.agent_sock.exists():
            if self.proc.poll() is not None:
                raise QemuFailed(self._qemu_stderr())
            if time.monotonic() > deadline:
                raise AssertionError(f"QEMU made no agent socket in 30 s: {self._qemu_stderr()}")
            time.sleep(0.05)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(self.agent_sock))
        self._reader = threading.Thread(target=self._read, name="vm-agent-reader", daemon=True)
        self._reader.start()
        self._wait_boot(None, t0, timeout)

    def _qemu_stderr(self) -> str:
        try:
            return (self.dir / "qemu.stderr").read_text(errors="replace").strip()[-2000:]
        except OSError:
            return "(no stderr)"

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._hellos.append("")  # the connection is gone: wake every waiter
                    self._cv.notify_all()
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # a line cut by a guest reset
                with self._cv:
                    if "hello" in msg:
                        self._hellos.append(str(msg["hello"]))
                    elif "id" in msg:
                        self._answers[msg["id"]] = msg
                    self._cv.notify_all()

    def _wait_boot(self, old: str | None, t0: float, timeout: float) -> None:
        """Wait for a hello with a boot id other than ``old``, then for systemd to finish booting."""
        deadline = t0 + timeout
        with self._cv:
            while True:
                fresh = [h for h in self._hellos if h and h != old]
                if fresh:
                    self.boot_id = fresh[-1]
                    self._hellos.clear()
                    break
                if self.proc.poll() is not None:
                    raise QemuFailed(self._qemu_stderr() or f"QEMU exited with {self.proc.returncode}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the guest did not boot within {timeout:.0f} s:\n{self.console()}")
                self._cv.wait(min(left, 1.0))
        r = self.run("systemctl", "is-system-running", "--wait", check=False,
                     timeout=max(5.0, deadline - time.monotonic()))
        state = r.stdout.strip()
        if state not in ("running", "degraded"):
            raise AssertionError(f"the guest's systemd says {state!r} after boot:\n{r.stderr}\n{self.console()}")
        self.boot_seconds.append(round(time.monotonic() - t0, 1))

    # -- inside

    def _send(self, req: dict) -> int:
        """Send one request to the agent; returns its id (the answer, if any, lands in _answers).
        Safe from several threads (``run`` may be called concurrently)."""
        with self._send_lock:  # one whole line at a time, whichever thread sends
            rid = self._next_id
            self._next_id += 1
            self.sock.sendall((json.dumps(dict(req, id=rid)) + "\n").encode())
        return rid

    def _request(self, req: dict, timeout: float) -> dict:
        rid = self._send(req)
        deadline = time.monotonic() + timeout + 30  # the agent kills the command at timeout; allow for TCG
        with self._cv:
            while rid not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None):
                    raise TimeoutError(f"no answer from the VM's agent for {req.get('argv') or req.get('put')} "
                                       f"within {timeout + 30:.0f} s")
                self._cv.wait(min(left, 1.0))
            return self._answers.pop(rid)

    def run(self, *argv: str, check: bool = True, timeout: float = 120, input: str | None = None) -> Result:
        """Run ``argv`` in the guest (as root, clean environment); killed with its group after ``timeout`` s.

        Raises:
            AssertionError: ``check`` and a non-zero exit status (command, status and output in it).
            TimeoutError: the agent did not answer (the guest is gone or wedged).
        """
        r = Result(list(argv), self._request({"argv": list(argv), "input": input, "timeout": timeout}, timeout))
        if check and r.returncode != 0:
            raise AssertionError(f"in VM: {' '.join(argv)} -> rc {r.returncode}"
                                 f"{' (timed out)' if r.timed_out else ''}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def sh(self, script: str, **kw) -> Result:
        """Run a shell script in the guest (see :meth:`run`)."""
        return self.run("/bin/sh", "-c", script, **kw)

    def put(self, path: str, data: bytes, mode: int = 0o644, timeout: float = 120) -> None:
        """Write ``data`` to ``path`` in the guest (atomically: the agent renames a temporary file)."""
        r = self._request({"put": path, "data": base64.b64encode(data).decode(), "mode": mode}, timeout)
        if r.get("rc") != 0:
            raise AssertionError(f"in VM: writing {path} failed: {r.get('stderr')}")

    def reboot(self, timeout: float = 600) -> None:
        """A real guest reboot (``systemctl reboot``); returns once the next boot is up.

        Raises:
            AssertionError: the guest did not come back within ``timeout`` s (console tail in it).
        """
        t0 = time.monotonic()
        old = self.boot_id
        self._send({"argv": ["systemctl", "reboot", "--no-block"], "input": None, "timeout": 60})
        self._wait_boot(old, t0, timeout)

    def reset(self, timeout: float = 600) -> None:
        """A hard reset of the guest (QMP ``system_reset``: no shutdown, what the guest had not
        written to its disk is lost); returns once the next boot is up.

        Raises:
            AssertionError: QEMU refused the reset, or the guest did not come back within ``timeout`` s.
        """
        t0 = time.monotonic()
        old = self.boot_id
        ans = self.qmp("system_reset")
        if "return" not in ans:
            raise AssertionError(f"QMP system_reset refused: {ans}")
        self._wait_boot(old, t0, timeout)

    def qmp(self, command: str, **arguments) -> dict:
        """One QMP command (e.g. ``system_reset``, ``quit``); returns QEMU's answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.qmp_sock))
            f = s.makefile("rwb")
            json.loads(f.readline())  # the greeting
            for msg in ({"execute": "qmp_capabilities"}, {"execute": command, "arguments": arguments}):
                f.write((json.dumps(msg) + "\n").encode())
                f.flush()
                while True:
                    line = f.readline()
                    if not line:
                        return {}
                    ans = json.loads(line)
                    if "event" not in ans:
                        break
            return ans

    def console(self, tail: int = 60) -> str:
        """The last ``tail`` lines of the guest's serial console."""
        try:
            return "\n".join(self.console_log.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return "(no console log)"

    # -- teardown

    def close(self, timeout: float = 60) -> None:
        """Power the guest off (agent, then QMP ``quit``, then SIGKILL of QEMU's PID); remove the directory."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                if self.sock is not None:
                    self._send({"argv": ["systemctl", "poweroff", "--no-block"], "timeout": 30})
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(Exception):
                    self.qmp("quit")
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None
        shutil.rmtree(self.dir, ignore_errors=True)


class QemuFailed(RuntimeError):
    """QEMU itself could not run this VM here (its stderr in the message): the tests skip on it."""

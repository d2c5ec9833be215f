"""A real OpenSSH server in each node namespace of a :class:`netcluster.Cluster`, with keys made
by the test, for the tests of ``sparkguard cluster lane|stop|start|restart``.

``with SshNodes(cluster, tmp) as s:`` makes, under ``tmp``: one ed25519 host key per node and one
client key (``ssh-keygen -q -N ''``), ``known_hosts`` naming each node's address with its own host
key, ``authorized_keys`` holding the client key, and per node an ``sshd_config``; then starts
``/usr/sbin/sshd -D -e -f <config>`` in each node's namespace (:meth:`Namespace.spawn`, so the
cluster's exit kills it too) and waits until its port accepts a TCP connection from the hub.

sshd listens on the node's address, port 22 (each namespace has its own port space).  Sessions
log in as root with the client key only (``PermitRootLogin prohibit-password``, no passwords, no
PAM: ``UsePAM no``; ``StrictModes no`` because the key files live in a pytest tmp dir whose
parents sshd(8) would otherwise check).  A session does not inherit the test's environment, so
the remote command runs the checkout under test explicitly: :attr:`remote_sparkguard` is
``("env", "PYTHONPATH=<ROOT>", sys.executable, "-m", "sparkguard")``.

SOURCE: sshd(8) "-D: sshd will not detach", "-e: write debug logs to standard error";
sshd_config(5) for every keyword used.  OpenSSH 9.2 (Debian 12) refuses to start without its
privilege-separation directory /run/sshd ("Missing privilege separation directory"); the
Debian service makes it at start (RuntimeDirectory=sshd); :func:`privsep_dir` makes it the same
way (root, 0755, empty) when missing and leaves it (another sshd may use it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT
from netcluster import Cluster, Namespace, Node, ns_socket

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
PRIVSEP_DIR = "/run/sshd"


def privsep_dir() -> None:
    """Make /run/sshd (root, 0755) when it does not exist (see the module's SOURCE)."""
    try:
        os.mkdir(PRIVSEP_DIR, 0o755)
    except FileExistsError:
        pass


def keygen(path: Path, comment: str) -> str:
    """A new ed25519 key at ``path`` (and ``path``.pub); the public key line.  Raises
    subprocess.CalledProcessError when ssh-keygen fails."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


def wait_port(netns: Namespace, addr: str, port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Return once ``addr:port`` accepts a TCP connection made from ``netns``.

    A refused connect is retried after 0.05 s (nothing signals "listening" from outside the
    process other than the port itself).  Raises AssertionError when ``proc`` exits first or
    nothing accepts within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"sshd on {addr} exited with {proc.returncode} before listening")
        s = ns_socket(netns.name)
        s.settimeout(2.0)
        try:
            s.connect((addr, port))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"sshd on {addr}:{port} not accepting within {timeout:g} s") from None
            time.sleep(0.05)
        finally:
            s.close()


class SshNodes:
    """sshd on every node of ``cluster``; keys and configs under ``tmp``.

    Attributes:
        dir: Path holding the keys, known_hosts, authorized_keys and sshd configs.
        identity: Path of the client's private key.
        known_hosts: Path of the client's known_hosts.
        procs: dict node name -> the sshd Popen (None once stopped).
        ssh_options: tuple of str, the ``-o`` values of :attr:`ClusterFile.ssh_options` that
            make the client use the test's key and known_hosts only.
        remote_sparkguard: tuple of str for :attr:`ClusterFile.remote_sparkguard`.
    """

    def __init__(self, cluster: Cluster, tmp: Path | str):
        self.cluster = cluster
        self.dir = Path(tmp) / "ssh"
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.identity = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.authorized_keys = self.dir / "authorized_keys"
        self.procs: dict[str, subprocess.Popen | None] = {}
        self.logs: dict[str, Path] = {}
        self.host_pubs: dict[str, str] = {}
        self.ssh_options = (f"IdentityFile={self.identity}", "IdentitiesOnly=yes",
                            f"UserKnownHostsFile={self.known_hosts}", "GlobalKnownHostsFile=/dev/null",
                            f"Port={SSH_PORT}", "User=root", "LogLevel=ERROR")
        self.remote_sparkguard = ("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "sparkguard")

    def __enter__(self) -> "SshNodes":
        try:
            privsep_dir()
            self.authorized_keys.write_text(keygen(self.identity, "sparkguard-test-client") + "\n")
            lines = []
            for node in self.cluster.nodes:
                hk = self.dir / f"host_{node.rank}_ed25519"
                pub = keygen(hk, f"host-{node.name}")
                self.host_pubs[node.name] = pub
                lines.append(f"{node.addr} {' '.join(pub.split()[:2])}")
            self.known_hosts.write_text("\n".join(lines) + "\n")
            for node in self.cluster.nodes:
                self.start(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def config(self, node: Node) -> Path:
        """Write and return the sshd_config of ``node``."""
        p = self.dir / f"sshd_{node.rank}.conf"
        p.write_text("\n".join([
            f"ListenAddress {node.addr}:{SSH_PORT}",
            f"HostKey {self.dir / f'host_{node.rank}_ed25519'}",
            f"PidFile {self.dir / f'sshd_{node.rank}.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "LogLevel INFO",
            "",
        ]))
        return p

    def start(self, node: Node) -> None:
        """Start sshd in ``node``'s namespace and wait until its port accepts from the hub."""
        log = self.dir / f"sshd_{node.rank}.log"
        self.logs[node.name] = log
        with open(log, "ab") as f:
            p = node.spawn([SSHD, "-D", "-e", "-f", str(self.config(node))], stdin=subprocess.DEVNULL,
                           stdout=f, stderr=f)
        self.procs[node.name] = p
        try:
            wait_port(self.cluster.hub, node.addr, SSH_PORT, p)
        except AssertionError as e:
            raise AssertionError(f"{e}; its log: {log.read_text()[-2000:]}") from None

    def stop(self, node: Node) -> None:
        """Stop ``node``'s sshd (SIGTERM to the sshd this harness started, bounded wait, SIGKILL)."""
        p = self.procs.get(node.name)
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs[node.name] = None

    def close(self) -> None:
        """Stop every sshd started here; idempotent (the key files go with the tmp dir)."""
        for node in self.cluster.nodes:
            self.stop(node)

    def ssh_cmd(self) -> tuple[str, ...]:
        """The ssh client's argv prefix that runs it in the cluster's hub namespace (for
        :data:`sparkguard.cluster.ssh.SSH` when run_all is called from the test process)."""
        return ("nsenter", f"--net=/var/run/netns/{self.cluster.hub.name}", "--", "ssh")


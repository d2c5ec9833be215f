"""Run one sparkguard command on several nodes at once over the operator's OpenSSH client.

Every node gets ``ssh -o BatchMode=yes -o StrictHostKeyChecking=yes [-o OPT ...] -- DEST
<remote command>`` in a thread of its own; the remote command is one string,
``shlex.join(cluster.remote_sparkguard + args [+ ("-c", node.config)])``, because sshd hands
it to the remote user's shell (ssh(1): "the command is executed on the remote host" by the
user's login shell, so the argv must be quoted for a POSIX shell).  Every failure comes back
as a :class:`RemoteResult`, never as an exception.

SOURCE for the exit status: ssh(1) "EXIT STATUS: ssh exits with the exit status of the remote
command or with 255 if an error occurred" (unreachable host, host key refused, authentication
failed); a remote command that itself exits 255 cannot be told apart by the status alone, so
:func:`ssh_failed` also requires ssh's own ``ssh: `` diagnostic on stderr (OpenSSH prints its
own errors with that prefix, e.g. "ssh: connect to host H port 22: Connection refused") or
the host-key banner ("Host key verification failed.").
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from sparkguard import untrusted
from sparkguard.cluster.model import ClusterFile, ClusterNode

#: the ssh client's argv prefix (looked up on PATH); the tests prefix ``nsenter --net=NS --``
#: to run it in their hub namespace
SSH: tuple[str, ...] = ("ssh",)
#: options every ssh gets first; ssh(1) takes the FIRST value of an option, so ssh_options of
#: the cluster file cannot override them (ssh_config(5): "the first obtained value ... will be used")
FORCED_OPTIONS = ("BatchMode=yes", "StrictHostKeyChecking=yes")
#: ssh's exit status for its own failure (ssh(1) EXIT STATUS)
SSH_ERROR = 255
#: bytes kept of each of stdout and stderr per node (the rest is read and dropped)
MAX_OUTPUT = 256 * 1024
#: ssh's own ConnectTimeout when the cluster file sets none, seconds
CONNECT_TIMEOUT = 10
#: keepalives when the cluster file sets none: ssh gives up on a node that stopped answering
#: after ServerAliveInterval x ServerAliveCountMax seconds (ssh_config(5)) instead of hanging
#: until the command's own timeout (a 330 s stop)
SERVER_ALIVE = ("ServerAliveInterval=15", "ServerAliveCountMax=3")

#: the ssh processes running now (run_one adds and removes them): what :func:`kill_all` ends
_live: set = set()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class RemoteResult:
    """One node's outcome of :func:`run_all`.

    Attributes:
        node: str, the node's name.
        rc: int or None, ssh's exit status (the remote command's, or 255 for ssh's own error);
            None when ssh did not exit (timed out and killed) or could not be started.
        stdout: str, the remote command's output (its first ``max_output`` bytes, default
            MAX_OUTPUT, decoded with replacement).
        stderr: str, its error output, with ssh's own messages mixed in.
        error: str or None, None when the remote command ran and exited 0; otherwise one
            sentence: ``"unreachable over SSH: <ssh's line>"``, ``"timed out after N s"``,
            ``"cannot run ssh: ..."`` or ``"exit status N: <last stderr line>"``.
        seconds: float, wall time of the ssh, seconds.
        truncated: bool, stdout was longer than what was kept.
    """

    node: str
    rc: int | None
    stdout: str
    stderr: str
    error: str | None
    seconds: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """The remote command ran and exited 0."""
        return self.error is None

    @property
    def ssh_error(self) -> bool:
        """ssh itself failed (the remote command never ran, or its outcome is unknown)."""
        return self.error is not None and self.error.startswith("unreachable over SSH")


def remote_argv(cluster: ClusterFile, node: ClusterNode, args: list[str] | tuple[str, ...]) -> list[str]:
    """The argv run on ``node``: ``cluster.remote_sparkguard + args``, then ``-c node.config``
    when the node names its config (every sparkguard subcommand that reads one takes ``-c``
    after its action)."""
    argv = [*cluster.remote_sparkguard, *args]
    if node.config:
        argv += ["-c", node.config]
    return argv


def ssh_argv(cluster: ClusterFile, node: ClusterNode, args: list[str] | tuple[str, ...]) -> list[str]:
    """The local ``ssh`` argv that runs :func:`remote_argv` on ``node``.

    ``ConnectTimeout`` and :data:`SERVER_ALIVE` are added after the cluster's options unless the
    file sets them.  ``ssh -o ... -- DEST COMMAND``: getopt(3) stops at ``--``, so a destination
    is never an option.

    Raises:
        ValueError: the node's destination is empty or starts with '-'."""
    argv = [*SSH]
    given = {o.split("=", 1)[0].strip().lower() for o in cluster.ssh_options}
    defaults = [o for o in (f"ConnectTimeout={CONNECT_TIMEOUT}", *SERVER_ALIVE) if o.split("=", 1)[0].lower() not in given]
    for opt in (*FORCED_OPTIONS, *cluster.ssh_options, *defaults):
        argv += ["-o", opt]
    if not node.ssh or node.ssh.startswith("-"):
        raise ValueError(f"node {node.name}: SSH destination {node.ssh!r} would be read as an option")
    # '--' ends ssh's options: the destination and the command are never read as options
    argv += ["--", node.ssh, shlex.join(remote_argv(cluster, node, args))]
    return argv


def ssh_failed(rc: int | None, stderr: str) -> str | None:
    """ssh's own diagnostic line when ``rc``/``stderr`` show that ssh failed, else None.

    ssh failed when it exited 255 and printed one of its own messages (see the module's
    SOURCE); a 255 without one is taken as the remote command's status."""
    if rc != SSH_ERROR:
        return None
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("ssh: ") or ln.startswith("Host key verification failed") or \
                "Permission denied (" in ln or ln.startswith("kex_exchange_identification") or \
                "Connection closed by" in ln or "REMOTE HOST IDENTIFICATION HAS CHANGED" in ln:
            if "REMOTE HOST IDENTIFICATION HAS CHANGED" in ln or "Host key verification failed" in ln:
                return "Host key verification failed (the node's host key is not the one in known_hosts)"
            return ln
    return None


def _drain(stream, box: list, limit: int) -> None:
    """Read ``stream`` to its end, keeping the first ``limit`` bytes in ``box[0]``; ``box[1]``
    is True when more came."""
    kept = bytearray()
    more = False
    try:
        while True:
            chunk = stream.read(65536)
            if not chunk:
                break
            room = limit - len(kept)
            more = more or len(chunk) > room
            kept += chunk[:max(room, 0)]
    except (OSError, ValueError):
        pass
    box.extend((bytes(kept), more))


def run_one(cluster: ClusterFile, node: ClusterNode, args: list[str] | tuple[str, ...],
            timeout: float, max_output: int = MAX_OUTPUT) -> RemoteResult:
    """Run ``args`` on ``node`` over ssh, waiting at most ``timeout`` seconds (then ssh is
    killed: SIGKILL to the ssh process this call started), keeping ``max_output`` bytes of
    stdout (stderr: MAX_OUTPUT).  Never raises for a failure of ssh or of the remote command:
    see :class:`RemoteResult`."""
    t0 = time.monotonic()
    argv = ssh_argv(cluster, node, args)
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    except OSError as e:
        return RemoteResult(node.name, None, "", "", f"cannot run ssh: {e.strerror or e}", time.monotonic() - t0)
    with _live_lock:
        _live.add(p)
    try:
        return _finish(p, node, timeout, max_output, t0)
    finally:
        with _live_lock:
            _live.discard(p)


def kill_all() -> list[int]:
    """SIGKILL every ssh process :func:`run_one` started that still runs (an operator's Ctrl-C:
    they run in sessions of their own, so the terminal's SIGINT does not reach them) and reap
    them; returns their pids.  The remote commands may still run to their end on the nodes."""
    with _live_lock:
        procs = list(_live)
    for p in procs:
        try:
            p.kill()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    return [p.pid for p in procs]


def _finish(p: subprocess.Popen, node: ClusterNode, timeout: float, max_output: int, t0: float) -> RemoteResult:
    """Wait for the ssh ``p`` of :func:`run_one` (its output read by two threads) and make its result."""
    out: list = []
    err: list = []
    readers = [threading.Thread(target=_drain, args=(p.stdout, out, max_output), daemon=True),
               threading.Thread(target=_drain, args=(p.stderr, err, MAX_OUTPUT), daemon=True)]
    for r in readers:
        r.start()
    timed_out = False
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        p.kill()
        p.wait()
    for r in readers:
        r.join(5.0)       # a remote child may hold the pipe after ssh died: the reader is a daemon thread
    for s in (p.stdout, p.stderr):
        try:
            s.close()
        except OSError:
            pass
    stdout = (out[0] if out else b"").decode(errors="replace")
    stderr = (err[0] if err else b"").decode(errors="replace")
    truncated = bool(out and out[1])
    seconds = time.monotonic() - t0
    if timed_out:
        return RemoteResult(node.name, None, stdout, stderr, f"timed out after {timeout:g} s", seconds, truncated)
    rc = p.returncode
    why = ssh_failed(rc, stderr)
    if why is not None:
        return RemoteResult(node.name, rc, stdout, stderr, f"unreachable over SSH: {why}", seconds, truncated)
    if rc != 0:
        last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        if not last:
            last = next((ln.strip() for ln in reversed(stdout.splitlines()) if ln.strip()), "no message")
        return RemoteResult(node.name, rc, stdout, stderr, f"exit status {rc}: {last}", seconds, truncated)
    return RemoteResult(node.name, rc, stdout, stderr, None, seconds, truncated)


def run_all(cluster: ClusterFile, nodes, args: list[str] | tuple[str, ...],
            timeout: float, max_output: int = MAX_OUTPUT) -> dict[str, RemoteResult]:
    """Run ``args`` on every node of ``nodes`` (ClusterNode values) in parallel, each bounded
    by ``timeout`` seconds; ``{node name: RemoteResult}`` in the order of ``nodes``.  Returns
    once every ssh has finished or been killed (about ``timeout`` + 5 s; at most ``timeout`` + 15 s,
    after which a node whose thread has not reported is a timeout)."""
    nodes = list(nodes)
    results: dict[str, RemoteResult] = {}
    lock = threading.Lock()

    def one(n: ClusterNode) -> None:
        try:
            r = run_one(cluster, n, args, timeout, max_output)
        except Exception as e:  # noqa: BLE001 - every failure is a result
            r = RemoteResult(n.name, None, "", "", f"cannot run ssh: {e}", 0.0)
        with lock:
            results[n.name] = r

    threads = [threading.Thread(target=one, args=(n,), name=f"ssh-{n.name}", daemon=True) for n in nodes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 15
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return {n.name: results.get(n.name) or RemoteResult(n.name, None, "", "", f"timed out after {timeout:g} s",
                                                         float(timeout)) for n in nodes}


def collect(cluster: ClusterFile, nodes, args: list[str] | tuple[str, ...], timeout: float,
            parse: Callable[[str], object], what: str) -> tuple[list[tuple[ClusterNode, object]], list[str]]:
    """:func:`run_all`, then ``parse(stdout)`` of every node whose command succeeded.

    Returns:
        ``(parsed, failures)``: ``[(node, parse(stdout)), ...]`` in the order of ``nodes``, and one
        line per node that failed (``"<node>: <error>"``, or ``"<node>: unreadable <what>: ..."``
        when ``parse`` raised: the output is another host's, so any exception of ``parse`` is that
        node's failure, never the caller's crash).  Every line is printable text
        (:func:`sparkguard.untrusted.clean`).
    """
    nodes = list(nodes)
    res = run_all(cluster, nodes, args, timeout)
    parsed, failures = [], []
    for n in nodes:
        r = res[n.name]
        if not r.ok:
            failures.append(describe(r))
            continue
        try:
            parsed.append((n, parse(r.stdout)))
        except Exception as e:  # noqa: BLE001 - see Returns
            failures.append(f"{n.name}: unreadable {what}: {untrusted.clean(e)}")
    return parsed, failures


def describe(r: RemoteResult) -> str:
    """One line for a person: ``"<node>: ok (1.2 s)"`` or ``"<node>: <error>"`` (the error's
    remote text with its control characters replaced, :func:`sparkguard.untrusted.clean`)."""
    return f"{r.node}: ok ({r.seconds:.1f} s)" if r.ok else f"{r.node}: {untrusted.clean(r.error)}"


"""A multi-node cluster on one machine: network namespaces joined by veth links to one bridge, and a
``sparkguard run`` per node, for the multi-node tests and ``bench/cluster.py``.

Topology of ``Cluster(n)`` (``<t>`` = 6 hex digits unique to the run; nothing is created in the
host's own network namespace, so the host's ``ip link`` never shows any of it)::

    hub namespace  sgcl-<t>-hub:  bridge sgbr<t>  10.X.Y.254/24
                                    |- sgv<t>n0  <-veth->  eth0 in sgcl-<t>-0   10.X.Y.1/24
                                    |- sgv<t>n1  <-veth->  eth0 in sgcl-<t>-1   10.X.Y.2/24
                                    `- ...                  (lo up in every namespace)

The bridge sits in a hub namespace of its own, so a test's bench client and scrapes run "on the
hub", which reaches every node, and the cluster can be torn down without touching a host link.
10.X.Y.0/24 is chosen at random among the /24s that overlap no IPv4 route of the host
(``/proc/net/route``): the namespaces have routing tables of their own, so this only keeps an
address seen in a log unambiguous.

Processes: :meth:`Namespace.spawn` runs ``nsenter --net=/var/run/netns/NAME -- ARGV``; without
``--fork`` nsenter(1) calls setns(2) and then execs ARGV in place, so the Popen's pid is the
program itself and its process tree is its own (sparkguard's tree logic sees what it would see
on a real node).  Client sockets in a namespace (:func:`ns_socket`) come from a short-lived
thread that setns(2)s itself into it: a network namespace is a per-thread attribute (setns(2)
"reassociate the calling thread") and a socket stays in the namespace it was created in
(network_namespaces(7)).

Cleanup (``Cluster.__exit__``, also after an exception or KeyboardInterrupt, and for a setup
cut short halfway): every :class:`SparkguardNode` is stopped (SIGTERM, bounded wait, SIGKILL)
and the engine processes it reported are SIGKILLed by pidfd; every process spawned through the
cluster and still running is SIGKILLed (it is our unreaped child, so its pid cannot have been
reused); the hub's veth ends (their peers go with them) and the bridge are deleted; the
namespaces are removed.  Only processes this module started are signalled.

Per-node sparkguard configs for one vLLM TP engine spanning the nodes: :func:`tp_configs` (each
written out), :func:`cluster_file` (one cluster file and a minimal config per node).
"""

from __future__ import annotations

import ctypes
import http.client
import ipaddress
import json
import os
import random
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from conftest import fake_vllm, sg_env, sparkguard_cmd
from supervisor_helpers import Daemon, kill_pids

NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000          # <linux/sched.h>
NODE_IF = "eth0"                   # the node's end of its veth, inside its namespace
HUB_HOST = 254                     # the hub's bridge address: 10.X.Y.254
METRICS_PORT = 8799                # sparkguard's default metrics port, free in every node's namespace
SMALL_FAKE = ("--hold", "8MiB", "--hold-core", "8MiB", "--hold-api", "8MiB")
MASTER_PORT = 29501                # vLLM's default (vllm/config/parallel.py ParallelConfig.master_port)

_libc = ctypes.CDLL(None, use_errno=True)


# --------------------------------------------------------------------------------------------
# sockets and HTTP inside a namespace

def ns_socket(netns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM,
              timeout: float = 5.0) -> socket.socket:
    """A new socket that lives in network namespace ``netns`` (a name under /var/run/netns).

    Raises OSError when the namespace cannot be entered, TimeoutError when the helper thread
    does not answer within ``timeout`` seconds.
    """
    box: dict = {}

    def enter() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["sock"] = socket.socket(family, kind)
        except BaseException as e:          # handed to the caller
            box["err"] = e

    t = threading.Thread(target=enter, name=f"ns-{netns}", daemon=True)
    t.start()
    t.join(timeout)
    if "err" in box:
        raise box["err"]
    if "sock" not in box:
        raise TimeoutError(f"no socket from namespace {netns} within {timeout} s")
    return box["sock"]


class _NsConnection(http.client.HTTPConnection):
    """http.client's connection with its socket made in a network namespace."""

    def __init__(self, netns: str, host: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.netns = netns

    def connect(self) -> None:
        self.sock = ns_socket(self.netns)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def http_request(netns: str, method: str, url: str, body: dict | None = None,
                 timeout: float = 5.0) -> tuple[int, bytes]:
    """One HTTP request from inside ``netns``: ``(status, body)``; ``body`` is sent as JSON.

    ``timeout`` (seconds) bounds the connect and each read; a wedged server therefore fails in
    about ``timeout``.  Raises OSError (TimeoutError, ConnectionRefusedError, ...) or
    http.client.HTTPException when no answer comes.
    """
    u = urlsplit(url)
    conn = _NsConnection(netns, u.hostname, u.port or 80, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, u.path + (f"?{u.query}" if u.query else "") or "/", body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[tuple, float]:
    """Prometheus text -> ``{(sample name, ((label, value), ...) sorted): value}``, parsed by
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# --------------------------------------------------------------------------------------------
# namespaces

def free_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A random 10.X.Y.0/24 that overlaps no IPv4 route of the host's main table (/proc/net/route)."""
    routes = []
    with open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            dest, mask = (int(parts[1], 16), int(parts[7], 16))
            if mask == 0:
                continue                                   # the default route overlaps everything
            # /proc/net/route prints the addresses as little-endian hex words
            d = ipaddress.IPv4Address(int.from_bytes(dest.to_bytes(4, "little"), "big"))
            m = ipaddress.IPv4Address(int.from_bytes(mask.to_bytes(4, "little"), "big"))
            routes.append(ipaddress.IPv4Network(f"{d}/{m}", strict=False))
    rng = rng or random.Random()
    for _ in range(1000):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(16, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(r) for r in routes):
            return net
    raise RuntimeError("no free 10.X.Y.0/24: every one tried overlaps a host route")


def _ipr(netns: str):
    """A pyroute2 IPRoute bound to ``netns``; made and closed by the calling thread (pyroute2
    objects belong to the thread that made them, FIELD-NOTES)."""
    from pyroute2 import IPRoute
    return IPRoute(netns=netns)


class Namespace:
    """One network namespace of a :class:`Cluster` (the hub or a node).

    Attributes:
        name: str, its name under /var/run/netns.
        cluster: the Cluster it belongs to.
    """

    def __init__(self, cluster: "Cluster", name: str):
        self.cluster = cluster
        self.name = name

    def spawn(self, argv: list[str], **popen_kw) -> subprocess.Popen:
        """Start ``argv`` in this namespace (``nsenter --net=... -- argv``, which execs in place:
        the Popen's pid is ``argv[0]`` itself).  Killed by the cluster's exit if still running."""
        p = subprocess.Popen(["nsenter", f"--net={os.path.join(NETNS_DIR, self.name)}", "--", *argv], **popen_kw)
        self.cluster._procs.append(p)
        return p

    def http_get(self, url: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET url`` from inside this namespace: ``(status, body)``; raises OSError (see :func:`http_request`)."""
        return http_request(self.name, "GET", url, timeout=timeout)

    def http_post(self, url: str, body: dict, timeout: float = 5.0) -> tuple[int, bytes]:
        """``POST url`` with a JSON ``body`` from inside this namespace (see :func:`http_request`)."""
        return http_request(self.name, "POST", url, body, timeout=timeout)

    def inode(self) -> int:
        """The namespace's inode number (equals ``os.stat(f"/proc/{pid}/ns/net").st_ino`` of its processes)."""
        return os.stat(os.path.join(NETNS_DIR, self.name)).st_ino


class Node(Namespace):
    """A node: a namespace with one veth to the hub's bridge.

    Attributes:
        rank: int, 0-based; the TP head is rank 0 in :func:`tp_configs`.
        addr: str, its IPv4 address on the bridge (``10.X.Y.<rank+1>``).
        hub_if: str, the hub's end of its veth.
    """

    def __init__(self, cluster: "Cluster", name: str, rank: int, addr: str, hub_if: str):
        super().__init__(cluster, name)
        self.rank, self.addr, self.hub_if = rank, addr, hub_if

    def _set_link(self, state: str) -> None:
        with _ipr(self.name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=NODE_IF)[0], state=state)

    def link_down(self) -> None:
        """Set the node's end of its veth down: the node drops off the bridge (a link drop)."""
        self._set_link("down")

    def link_up(self) -> None:
        """Set the node's end of its veth up again (the kernel keeps its address)."""
        self._set_link("up")

    def link_is_up(self) -> bool:
        """Whether the node's veth end is administratively up."""
        with _ipr(self.name) as ipr:
            link = ipr.get_links(ipr.link_lookup(ifname=NODE_IF)[0])[0]
            return bool(link["flags"] & 1)          # IFF_UP


class Cluster:
    """``with Cluster(n) as c:`` n nodes (``c.nodes``) on one bridge in hub namespace ``c.hub``.

    Args:
        n: int >= 1 number of nodes.
    Attributes:
        tag: str, 6 hex digits in every name of this cluster.
        subnet: ipaddress.IPv4Network of the bridge.
        hub: Namespace holding the bridge (address ``hub_addr``).
        nodes: list[Node], ``nodes[k].addr`` = 10.X.Y.<k+1>.
    Raises OSError / pyroute2 errors when a namespace or link cannot be made (after removing
    what was made).
    """

    def __init__(self, n: int):
        if n < 1 or n > 200:
            raise ValueError(f"1..200 nodes, got {n}")
        self.n = n
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = free_subnet()
        self.bridge = f"sgbr{self.tag}"
        self.hub = Namespace(self, f"sgcl-{self.tag}-hub")
        self.hub_addr = str(self.subnet.network_address + HUB_HOST)
        self.nodes: list[Node] = []
        self._made: list[str] = []                      # namespaces created, in order
        self._procs: list[subprocess.Popen] = []
        self._daemons: list["SparkguardNode"] = []

    def names(self) -> list[str]:
        """Every namespace name this cluster uses (made or not)."""
        return [self.hub.name] + [f"sgcl-{self.tag}-{k}" for k in range(self.n)]

    def links(self) -> list[str]:
        """Every interface name of the hub (bridge and veth ends)."""
        return [self.bridge] + [f"sgv{self.tag}n{k}" for k in range(self.n)]

    def __enter__(self) -> "Cluster":
        try:
            self._make_hub()
            for k in range(self.n):
                self._add_node(k)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        from pyroute2 import netns
        netns.create(name)
        self._made.append(name)

    def _make_hub(self) -> None:
        self._netns(self.hub.name)
        with _ipr(self.hub.name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.link("add", ifname=self.bridge, kind="bridge")
            br = ipr.link_lookup(ifname=self.bridge)[0]
            ipr.addr("add", index=br, address=self.hub_addr, prefixlen=self.subnet.prefixlen)
            ipr.link("set", index=br, state="up")

    def _add_node(self, k: int) -> None:
        name, hub_if = f"sgcl-{self.tag}-{k}", f"sgv{self.tag}n{k}"
        addr = str(self.subnet.network_address + k + 1)
        self._netns(name)
        with _ipr(self.hub.name) as ipr:
            ipr.link("add", ifname=hub_if, kind="veth", peer={"ifname": NODE_IF, "net_ns_fd": name})
            idx = ipr.link_lookup(ifname=hub_if)[0]
            ipr.link("set", index=idx, master=ipr.link_lookup(ifname=self.bridge)[0])
            ipr.link("set", index=idx, state="up")
        with _ipr(name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            eth = ipr.link_lookup(ifname=NODE_IF)[0]
            ipr.addr("add", index=eth, address=addr, prefixlen=self.subnet.prefixlen)
            ipr.link("set", index=eth, state="up")
        self.nodes.append(Node(self, name, k, addr, hub_if))

    def close(self) -> None:
        """Stop every SparkguardNode, kill every spawned process, delete links and namespaces.

        Idempotent; each step runs even when an earlier one failed.  Raises the first error
        met once everything was tried.
        """
        from pyroute2 import netns
        errors: list[BaseException] = []
        for d in reversed(self._daemons):
            try:
                d.cleanup()
            except BaseException as e:  # noqa: BLE001 - keep cleaning up, re-raised below
                errors.append(e)
        self._daemons.clear()
        for p in self._procs:
            try:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        self._procs.clear()
        if self.hub.name in self._made:
            try:
                with _ipr(self.hub.name) as ipr:
                    for ifname in reversed(self.links()):     # veths first (each takes its peer), then the bridge
                        idx = ipr.link_lookup(ifname=ifname)
                        if idx:
                            ipr.link("del", index=idx[0])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        for name in reversed(self._made):
            try:
                netns.remove(name)
            except FileNotFoundError:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        self._made.clear()
        self.nodes = []
        if errors:
            raise errors[0]


# --------------------------------------------------------------------------------------------
# sparkguard on a node

class SparkguardNode(Daemon):
    """``sparkguard run -c CFG`` in ``node``'s namespace; stopped and cleaned up by the cluster's exit.

    Everything of :class:`supervisor_helpers.Daemon` applies (``wait_line``, ``mark``,
    ``status()``/``ctl()`` over the control socket, ``wait_ready``, ``incident``, ``engine_pids``
    from the forwarded "fake-vllm: ready pids=..." lines, ``cleanup``).

    Args:
        node: the Node to run on.
        cfg: config dict (e.g. one of :func:`tp_configs`); written to ``workdir/sparkguard.yaml``.
            Its ``metrics.listen`` (``host:port``) is what :meth:`scrape` reads.
        workdir: per-node folder (made if missing).
    """

    def __init__(self, node: Node, cfg: dict, workdir: Path | str, name: str = "sparkguard"):
        # Daemon's attributes, with the process started in the node's namespace
        self.node = node
        self.tmp_path = Path(workdir)
        self.tmp_path.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.path = self.tmp_path / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.socket = cfg.get("engine", {}).get("control_socket")
        self.lines: list[str] = []
        self.cv = threading.Condition()
        self.engine_pids: dict[int, int] = {}
        listen = (cfg.get("metrics") or {}).get("listen", "off")
        self.metrics_url = None if listen in (None, False, "off") else f"http://{listen}/metrics"
        self.proc = node.spawn(sparkguard_cmd("run", "-c", str(self.path)), env=sg_env(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, errors="replace")
        node.cluster._daemons.append(self)
        self.reader = threading.Thread(target=self._read, name=f"sg-{node.name}", daemon=True)
        self.reader.start()

    def scrape(self, via: Namespace | None = None, timeout: float = 5.0) -> dict[tuple, float]:
        """This node's metrics read over HTTP from namespace ``via`` (default: the hub), parsed
        with :func:`parse_metrics`.  Raises OSError when unreachable, AssertionError on non-200."""
        via = via or self.node.cluster.hub
        status, body = via.http_get(self.metrics_url, timeout)
        assert status == 200, f"{self.metrics_url}: HTTP {status}"
        return parse_metrics(body.decode())

    def wait_metrics(self, timeout: float = 30.0, via: Namespace | None = None) -> dict[tuple, float]:
        """Once the daemon logged "metrics on URL" (it logs that when the endpoint is bound),
        one :meth:`scrape`; AssertionError when the line does not come within ``timeout``."""
        self.wait_line(r"metrics on http://", timeout)
        return self.scrape(via)

    def engine_process(self, title: str | None = None) -> tuple[int, int]:
        """``(pid, starttime)`` of this node's running engine process whose cmdline starts with
        ``title`` (e.g. ``"VLLM::Worker_TP1"``, ``"VLLM::EngineCore"``), or of the engine's top
        (the ``vllm serve`` process, from status) when ``title`` is None.  Only processes the
        daemon reported ("fake-vllm: ready pids=") are considered.  Raises LookupError."""
        from sparkguard import proctree
        pids = [self.status()["pid"]] if title is None else self.alive_engine_pids()
        for pid in pids:
            p = proctree.read_proc(pid) if pid else None
            if p is None:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if title is None or cmdline.startswith(title.encode()):
                return pid, p.starttime
        raise LookupError(f"no engine process {title or '(top)'} on {self.node.name}: {self.alive_engine_pids()}")

    def kill_engine(self, title: str | None = None) -> int:
        """SIGKILL (pidfd, start time checked) the engine process :meth:`engine_process` finds; its pid."""
        pid, st = self.engine_process(title)
        kill_pids({pid: st})
        return pid

    def cleanup(self) -> None:
        """Stop the daemon (SIGTERM, 30 s, SIGKILL), then SIGKILL (pidfd, start time checked)
        every engine process it reported, and every process below it just before the stop (an
        engine that never reported ready), that still runs; idempotent."""
        from sparkguard import proctree
        if self.proc.poll() is None:
            procs = proctree.scan()
            for pid in proctree.descendants([self.proc.pid], proctree.children_map(procs)):
                if pid != self.proc.pid:
                    self.engine_pids.setdefault(pid, procs[pid].starttime)
        if self.proc.poll() is None or self.reader.is_alive():
            self.stop()
        kill_pids(self.engine_pids)


def value(metrics: dict[tuple, float], name: str, **labels: str) -> float | None:
    """The sample ``name`` whose labels include ``labels`` (the first such) or None."""
    for (n, ls), v in metrics.items():
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items()):
            return v
    return None


# --------------------------------------------------------------------------------------------
# configs for one TP engine spanning the nodes

def tp_argv(model: str, cluster: Cluster, rank: int, *, tp: int | None = None, master_port: int = MASTER_PORT,
            port: int = 8000, load_time: float = 2.0, fake_opts: tuple[str, ...] = SMALL_FAKE) -> list[str]:
    """argv of the fake vLLM for ``rank`` of a TP engine over every node of ``cluster``.

    Head (rank 0): ``vllm serve M --tensor-parallel-size N --nnodes K --node-rank 0 --master-addr
    <head addr> --master-port P --host <head addr> --port PORT --load-time T``; rank k > 0 the
    same with ``--node-rank k --headless`` (vLLM multi-node without Ray, FIELD-NOTES "vLLM").
    ``tp`` defaults to one rank per node.  ``fake_opts`` (memory held) follow.
    """
    head = cluster.nodes[0].addr
    args = ["--tensor-parallel-size", str(tp or cluster.n), "--nnodes", str(cluster.n),
            "--node-rank", str(rank), "--master-addr", head, "--master-port", str(master_port),
            "--host", head, "--port", str(port),
            "--load-time", f"{load_time:g}"]
    if rank > 0:
        args.append("--headless")
    return fake_vllm.command(model, *args, *fake_opts)


def tp_configs(cluster: Cluster, model: str, workdir: Path | str, *, engine: dict | None = None,
               guard: dict | None = None, metrics_port: int = METRICS_PORT, **argv_kw) -> list[dict]:
    """One sparkguard config dict per node for a TP engine spanning ``cluster`` (rank k on node k).

    Every node: ``engine.command`` from :func:`tp_argv` (``argv_kw``: tp, master_port, port,
    load_time, fake_opts), files under ``workdir/node<k>/`` (state file, control socket,
    incidents), metrics on ``<node addr>:metrics_port``, ``engine.peers`` = every OTHER node's
    metrics URL, engine output to stderr (so "fake-vllm: ready pids=" reaches SparkguardNode),
    journal off, ``targets.match`` the model name.  Head: ``engine.health_url`` its own
    ``/health``.  Headless: ``engine.head_url`` the head's ``/health``.

    What this machine forces, nothing else (sparkguard's defaults apply to every timer): memory
    gates small (``start_above: 64MiB``), ``drop_caches: false`` (a shared machine's page cache
    is not ours to drop), the guard line far below MemAvailable (``term_below: 128MiB``).
    ``engine`` / ``guard`` are merged over the result (e.g. a test's faster timers).
    """
    workdir = Path(workdir)
    port = argv_kw.get("port", 8000)
    head = cluster.nodes[0]
    urls = [f"http://{n.addr}:{metrics_port}/metrics" for n in cluster.nodes]
    out = []
    for node in cluster.nodes:
        d = workdir / f"node{node.rank}"
        e = {
            "command": tp_argv(model, cluster, node.rank, **argv_kw),
            "log": "stderr", "drop_caches": False, "start_above": "64MiB",
            "state_file": str(d / "engine-state.json"),
            "control_socket": str(d / "control.sock"),
            "peers": [u for k, u in enumerate(urls) if k != node.rank],
        }
        if node.rank == 0:
            e["health_url"] = f"http://{head.addr}:{port}/health"
        else:
            e["head_url"] = f"http://{head.addr}:{port}/health"
        e.update(engine or {})
        g = {"term_below": "128MiB"}
        g.update(guard or {})
        out.append({
            "guard": g,
            "targets": {"match": [model]},
            "metrics": {"listen": f"{node.addr}:{metrics_port}"},
            "incidents": {"dir": str(d / "incidents"), "journal": "off"},
            "engine": e,
        })
    return out


def start_nodes(cluster: Cluster, cfgs: list[dict], workdir: Path | str) -> list[SparkguardNode]:
    """A SparkguardNode per config, headless ranks first and the head last (as the public
    multi-Spark recipes start them, FIELD-NOTES); ``result[k]`` runs on ``cluster.nodes[k]``."""
    workdir = Path(workdir)
    daemons: dict[int, SparkguardNode] = {}
    for k in list(range(1, len(cfgs))) + [0]:
        daemons[k] = SparkguardNode(cluster.nodes[k], cfgs[k], workdir / f"node{k}")
    return [daemons[k] for k in range(len(cfgs))]


# --------------------------------------------------------------------------------------------
# the same engine from one cluster file (docs/cluster.md)

def cluster_file(cluster: Cluster, model: str, workdir: Path | str, *, engine: dict | None = None,
                 guard: dict | None = None, lanes: dict | None = None, nodes: list[dict] | None = None,
                 tp: int | None = None, port: int = 8000, load_time: float = 2.0,
                 fake_opts: tuple[str, ...] = SMALL_FAKE, metrics_port: int = METRICS_PORT,
                 name: str | None = None) -> tuple[Path, list[dict]]:
    """A cluster file for a TP engine spanning ``cluster`` and the minimal sparkguard.yaml of each node.

    The cluster file (``workdir/cluster.yaml``): nodes ``node0``.. in rank order with their
    addresses, the fake vLLM's shared command (``serve MODEL --tensor-parallel-size N --host <head
    addr> --port PORT --load-time T`` + ``fake_opts``: :func:`tp_argv` without the flags the file
    derives), ``lanes`` and ``engine`` (timers) merged into its ``engine:``; ``nodes[k]`` (a dict)
    merged into node k's entry (its env, args, lanes).  Each node's config: ``cluster: {file,
    node: node<k>}`` and what this machine forces, as :func:`tp_configs` (files under
    ``workdir/node<k>/``, engine output to stderr, ``drop_caches: false``, ``start_above: 64MiB``,
    ``term_below: 128MiB`` merged with ``guard``, ``targets.match`` the model); metrics.listen,
    peers and the head URLs come from the cluster file.

    Returns:
        (path of the cluster file, [config dict of node k]).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    head = cluster.nodes[0].addr
    shared = {"command": fake_vllm.command(model, "--tensor-parallel-size", str(tp or cluster.n), "--host", head,
                                           "--port", str(port), "--load-time", f"{load_time:g}", *fake_opts)}
    if lanes is not None:
        shared["lanes"] = lanes
    shared.update(engine or {})
    entries = []
    for node in cluster.nodes:
        entry = {"name": f"node{node.rank}", "addr": node.addr}
        entry.update((nodes or [{}] * cluster.n)[node.rank])
        entries.append(entry)
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump({"name": name or f"sgcl-{cluster.tag}", "metrics_port": metrics_port,
                                    "nodes": entries, "engine": shared}, sort_keys=False))
    cfgs = []
    for node in cluster.nodes:
        d = workdir / f"node{node.rank}"
        cfgs.append({
            "cluster": {"file": str(path), "node": f"node{node.rank}"},
            "guard": {"term_below": "128MiB", **(guard or {})},
            "targets": {"match": [model]},
            "incidents": {"dir": str(d / "incidents"), "journal": "off"},
            "engine": {"log": "stderr", "drop_caches": False, "start_above": "64MiB",
                       "state_file": str(d / "engine-state.json"), "control_socket": str(d / "control.sock")},
        })
    return path, cfgs

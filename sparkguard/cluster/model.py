"""The cluster file's model and one node's status as ``sparkguard cluster`` reads it: plain
frozen data shared by the file's loader (:mod:`sparkguard.cluster.file`), the reader of every
node's metrics (:mod:`sparkguard.cluster.view`) and the SSH operations
(:mod:`sparkguard.cluster.ops`).  No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the head's node rank (vLLM: ``--node-rank 0`` serves the API; the others run ``--headless``)
HEAD_RANK = 0


def host_port(host: str, port: int) -> str:
    """``host:port`` for a URL, an IPv6 literal in brackets (RFC 3986 section 3.2.2)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class ClusterNode:
    """One node of the cluster file, in rank order.

    Attributes:
        name: str, the node's name, unique in the file; a node finds itself by its hostname
            (``socket.gethostname()``, first label compared too) unless its sparkguard.yaml names it.
        rank: int, vLLM's ``--node-rank`` (0 is the head).
        addr: str, the node's address on the cluster link: the head's is ``--master-addr``;
            every node's metrics endpoint listens there.
        ssh: str, the SSH destination (``[user@]host``) the operator's ``ssh`` reaches it by.
        metrics_port: int, TCP port of its metrics endpoint.
        env: dict str -> str, environment added to this node's engine only (e.g. VLLM_HOST_IP,
            NCCL_SOCKET_IFNAME: they name this node's own address and interface).
        args: tuple of str, arguments appended to this node's engine command only.
        lanes: dict lane name -> :class:`sparkguard.config.engine.LaneConfig`, this node's
            additions to a shared lane (its args appended, its env merged over); every name is a
            shared lane (the file's loader refuses one that is not).
        config: str or None, the path of this node's sparkguard.yaml on that node, passed as
            ``-c`` to the commands run there over SSH; None: its default
            (/etc/sparkguard/sparkguard.yaml).
    """

    name: str
    rank: int
    addr: str
    ssh: str
    metrics_port: int
    env: dict = field(default_factory=dict)
    args: tuple[str, ...] = ()
    lanes: dict = field(default_factory=dict)
    config: str | None = None

    @property
    def role(self) -> str:
        """``"head"`` (rank 0) or ``"headless"``: the roles of sparkguard.supervisor.cluster.Role."""
        return "head" if self.rank == HEAD_RANK else "headless"

    @property
    def metrics_url(self) -> str:
        """``http://<addr>:<metrics_port>/metrics``: what peers and ``sparkguard cluster status`` read."""
        return f"http://{host_port(self.addr, self.metrics_port)}/metrics"


@dataclass(frozen=True)
class ClusterFile:
    """A loaded, validated cluster file (the same file on every node).

    Attributes:
        path: str, the file it was read from (named in errors).
        name: str, the cluster's name: the ``cluster`` label of ``sparkguard_cluster_info`` and
            the first column of what ``sparkguard cluster`` prints.
        nodes: tuple of :class:`ClusterNode`, in rank order (``nodes[k].rank == k``).
        engine: dict, the raw ``engine:`` mapping shared by every node (the engine command without
            the multi-node flags the loader derives, lanes, timers), validated through the config
            schema when a node's config is built from it.
        master_port: int, vLLM's ``--master-port`` (the rendezvous port on the head).
        api_port: int, the head's HTTP port (vLLM ``--port``): health and readiness are read there.
        ssh_options: tuple of str, extra ``-o KEY=VALUE`` options for every ``ssh`` the operations run
            (``BatchMode=yes`` and ``StrictHostKeyChecking=yes`` are always given and cannot be
            overridden here).
        remote_sparkguard: tuple of str, the command that runs sparkguard on a node over SSH
            (e.g. ``("sudo", "-n", "sparkguard")`` for an operator who is not root there).
        digest: str or None, the first 12 hex digits of the SHA-256 of the file's bytes (what
            every node reports in ``sparkguard_cluster_info{digest}``: one file everywhere is one
            digest); None for a ClusterFile not read from a file.
    """

    path: str
    name: str
    nodes: tuple[ClusterNode, ...]
    engine: dict
    master_port: int = 29501
    api_port: int = 8000
    ssh_options: tuple[str, ...] = ()
    remote_sparkguard: tuple[str, ...] = ("sparkguard",)
    digest: str | None = None

    @property
    def head(self) -> ClusterNode:
        """The node of rank 0."""
        return self.nodes[HEAD_RANK]

    @property
    def lanes(self) -> tuple[str, ...]:
        """The shared lanes' names, in the file's order (empty without ``engine.lanes``)."""
        return tuple((self.engine.get("lanes") or {}).keys())

    def node(self, name: str) -> ClusterNode:
        """The node called ``name``.  Raises KeyError."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


@dataclass(frozen=True)
class NodeStatus:
    """One node as ``sparkguard cluster`` read it from its metrics endpoint (one HTTP GET).

    Attributes:
        node: :class:`ClusterNode`, the node of the cluster file.
        up: bool, its sparkguard answered with a metrics page.
        error: str or None, why not (connection refused, timeout, HTTP status, not sparkguard).
        cluster: str or None, the cluster name it runs with (``sparkguard_cluster_info``); None
            when it runs without a cluster file.
        role: str or None, ``single``/``head``/``headless`` (``sparkguard_engine_role_info``).
        node_rank: int or None, its ``--node-rank``.
        state: str or None, the supervisor's state (``sparkguard_engine_state``).
        lane: str or None, the lane its engine runs or will start in (``sparkguard_engine_lane_info``).
        lanes: tuple of str, the lanes its config has (``sparkguard_engine_lanes_info``).
        ready: bool, its engine is serving (state ``ready``).
        run_start: float or None, unix seconds its current run started (the run's name across nodes).
        joined_run_start: float or None, a headless rank: the head's run it joined.
        mem_available: int or None, MemAvailable in bytes.
        last_incident: tuple (id, kind) or None.
        given_up: bool, its supervisor stopped restarting (``sparkguard_engine_given_up``).
        node_name: str or None, the node name its cluster file gives it (``sparkguard_cluster_info{node}``).
        nnodes: int or None, the number of nodes of its cluster file.
        digest: str or None, its cluster file's digest (:attr:`ClusterFile.digest`).
    """

    node: ClusterNode
    up: bool
    error: str | None = None
    cluster: str | None = None
    role: str | None = None
    node_rank: int | None = None
    state: str | None = None
    lane: str | None = None
    lanes: tuple[str, ...] = ()
    ready: bool = False
    run_start: float | None = None
    joined_run_start: float | None = None
    mem_available: int | None = None
    last_incident: tuple[str, str] | None = None
    given_up: bool = False
    node_name: str | None = None
    nnodes: int | None = None
    digest: str | None = None

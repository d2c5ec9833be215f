"""The TP cluster as one engine: each node's role, what the other nodes' sparkguards report, and
the decisions that follow.  Pure: no clock, no I/O (the readings come from :mod:`.nodes`).

One vLLM engine spans N nodes (``--nnodes N``): the head (``--node-rank 0``) serves the API and
hosts the rendezvous, every other node runs ``--node-rank k --headless`` ranks.  The group forms
once every rank has joined; after that a rank that dies on any node stalls the whole group (the
head keeps answering ``/health`` 200 until the distributed timeout, 600 s by default), and a rank
that starts while an old head is alive joins its stale rendezvous and never serves (FIELD-NOTES
"What the public multi-Spark recipes do", "vLLM multi-node timeouts").  Every node runs sparkguard
supervising its own rank; they coordinate through what each already serves, its metrics
endpoint (``engine.peers``), with no protocol of their own:

* a **run** is named by its start time (``sparkguard_engine_run_start_timestamp_seconds``, unix
  seconds on the node's own clock); other nodes only compare it for equality, so clocks need not
  agree;
* **order**: a headless rank starts only while the head has no run (and wants one); the head
  starts last, once every headless rank runs and waits for a head (:func:`head_start_gate`), and
  records the run of each rank it starts with: its **group** (``..._group_run_start_...{node_rank}``);
* **joined**: a headless run is in the head's current group when the head lists that very run for
  its rank (:func:`joined`); it is ``ready`` only then and while the head is ready, and ``waiting
  for head`` before;
* **broken**: the head restarts at once (reason ``peer``) when a rank of its group has a run other
  than the one it started with (:func:`broken_group`); a headless rank restarts at once (reason
  ``head``) when the head run it joined is gone, or a head run it was exposed to (alive while it
  waited, not its group) ended (:class:`HeadWatch`); a head stopped on purpose (``engine stop``,
  given up) means stop and wait, not restart;
* **unreachable is not dead**: a node whose endpoint does not answer decides nothing; its last
  reading stands (a dead rank shows as a changed run once it answers, and the head's own NCCL
  timeout, the liveness probe and ``engine.head_lost_after`` still apply).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Role:
    """A node's part in the engine, from the vLLM command line.

    Attributes:
        role: ``"single"`` (one node), ``"head"`` (``--nnodes N > 1``, node rank 0) or
            ``"headless"`` (``--headless``).
        node_rank: int (``--node-rank``, 0 when absent).
        nnodes: int (``--nnodes``, 1 when absent).
    """

    role: str = "single"
    node_rank: int = 0
    nnodes: int = 1

    @property
    def clustered(self) -> bool:
        """True for a head or a headless rank."""
        return self.role != "single"


def flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--x v`` or ``--x=v``), or None."""
    val = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                val = argv[i + 1]
            elif a.startswith(n + "="):
                val = a[len(n) + 1:]
    return val


def role_of(argv: list[str] | tuple[str, ...] | None) -> Role:
    """The :class:`Role` a vLLM command gives its node.

    Only what follows ``serve`` is read (a wrapper in front, ``nice -n 10`` or ``chrt -r 1``, has
    flags of its own); a command without ``serve`` is not vLLM's: single.  vLLM spells its flags
    with dashes and accepts underscores (its FlexibleArgumentParser, vllm/utils/argparse_utils.py);
    both are read.  A value that is not an integer counts as absent (vLLM refuses it at start).
    """
    args = [str(a) for a in argv or ()]
    if "serve" not in args:
        return Role()
    args = args[args.index("serve") + 1:]

    def num(names: tuple[str, ...], default: int) -> int:
        v = flag_value(args, names)
        try:
            return int(v) if v is not None else default
        except ValueError:
            return default

    nnodes = num(("--nnodes",), 1)
    rank = num(("--node-rank", "--node_rank"), 0)
    if "--headless" in args:
        return Role("headless", rank, nnodes)
    if nnodes > 1:
        return Role("head" if rank == 0 else "headless", rank, nnodes)
    return Role()


@dataclass(frozen=True)
class NodeView:
    """Another node's sparkguard, as one reading of its metrics shows it.

    Attributes:
        url: str, the metrics URL read.
        error: str, why it could not be read; "" when read (then the rest is what it said).
        available_bytes: int MemAvailable, or None.
        role, node_rank, nnodes: its :class:`Role` (None when it supervises no engine).
        state: str, its supervisor state (``sparkguard.supervisor.STATES``), or None.
        wanted: bool, False when its engine is stopped on purpose or given up.
        given_up: bool.
        run: float, the start of its current run (its clock), None when no run is alive.
        ready: bool, its engine is ready (a headless rank: joined and the head ready).
        joined: float, a headless rank: the head run it is in; None while waiting.
        group: ``{node_rank: run}``, a head: the run of each rank it started with.
        last_incident: str, the id of its last incident, or None; last_incident_at: its start
            (unix s, that node's clock), or None.
    """

    url: str
    error: str = ""
    available_bytes: int | None = None
    role: str | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    state: str | None = None
    wanted: bool = True
    given_up: bool = False
    run: float | None = None
    ready: bool = False
    joined: float | None = None
    group: dict = field(default_factory=dict)
    last_incident: str | None = None
    last_incident_at: float | None = None

    @property
    def reachable(self) -> bool:
        return not self.error

    def name(self) -> str:
        """``"node rank 1 (http://...)"`` for messages."""
        rank = f"node rank {self.node_rank}" if self.node_rank is not None else "node"
        return f"{rank} ({self.url})"

    def as_dict(self) -> dict:
        """JSON-ready (status, incident causes)."""
        return {"url": self.url, "error": self.error, "available_bytes": self.available_bytes,
                "role": self.role, "node_rank": self.node_rank, "nnodes": self.nnodes, "state": self.state,
                "wanted": self.wanted, "given_up": self.given_up, "run": self.run, "ready": self.ready,
                "joined": self.joined, "group": {str(k): v for k, v in self.group.items()},
                "last_incident": self.last_incident, "last_incident_at": self.last_incident_at}


def find_head(views: list[NodeView]) -> NodeView | None:
    """The reachable view whose role is ``head``, else None."""
    for v in views:
        if v.reachable and v.role == "head":
            return v
    return None


def waiting_for_head(v: NodeView) -> bool:
    """A headless rank that runs and is in no head's group: what the head waits for before it starts."""
    return (v.reachable and v.role == "headless" and v.wanted and not v.given_up and v.run is not None
            and v.joined is None)


def head_start_gate(me: Role, views: list[NodeView]) -> tuple[bool, str]:
    """May the head start now?  ``(ok, what it waits for)``.

    Every other rank (node ranks 1..N-1) must be read and waiting for a head: workers first,
    head last, and no rank of an old group alive anywhere (an old rank would sit in the new
    head's rendezvous and exit when its old head's timeout ends it).
    """
    ranks: dict = {}
    missing = []
    for v in views:
        if not v.reachable or v.role is None:
            continue
        if v.role != "headless" or v.nnodes != me.nnodes or not 1 <= (v.node_rank or 0) < me.nnodes:
            missing.append(f"{v.name()}: is {v.role} rank {v.node_rank} of {v.nnodes} nodes, not a headless "
                           f"rank 1..{me.nnodes - 1} of {me.nnodes} (check its engine.command)")
        elif v.node_rank in ranks:
            missing.append(f"{v.name()} and {ranks[v.node_rank].url} both claim node rank {v.node_rank}")
        else:
            ranks[v.node_rank] = v
    if missing:
        return False, "; ".join(missing)
    for k in range(1, me.nnodes):
        v = ranks.get(k)
        if v is None:
            missing.append(f"node rank {k}: not read" + _errors(views) + _roleless(views))
        elif not waiting_for_head(v):
            missing.append(f"{v.name()}: {_why_not_waiting(v)}")
    return (not missing), "; ".join(missing)


def _roleless(views: list[NodeView]) -> str:
    names = [v.url for v in views if v.reachable and v.role is None]
    return (f" ({', '.join(names)}: read, but export no engine role: no engine configured there, or a "
            "sparkguard without cluster support)") if names else ""


def _errors(views: list[NodeView]) -> str:
    errs = [f"{v.url}: {v.error}" for v in views if not v.reachable]
    return f" ({', '.join(errs)})" if errs else ""


def _why_not_waiting(v: NodeView) -> str:
    if v.given_up:
        return "has given up (needs `sparkguard engine start` there)"
    if not v.wanted:
        return "stopped on purpose"
    if v.run is None:
        return f"no rank running ({v.state or 'no engine'})"
    return "still in an old head's group"


def head_may_start_rank(head: NodeView | None) -> tuple[bool, str]:
    """May a headless rank start now?  ``(ok, what it waits for)``: the head is read, wants its
    engine, and has no run alive (it starts last)."""
    if head is None:
        return False, "no head read yet"
    if head.given_up:
        return False, f"head {head.url} has given up (needs `sparkguard engine start` there)"
    if not head.wanted:
        return False, f"head {head.url} is stopped on purpose"
    if head.run is not None:
        return False, f"head {head.url} still runs an old group (run started {head.run:.3f})"
    return True, ""


def joined(my_rank: int, my_run: float | None, head: NodeView | None) -> bool:
    """True when ``head``'s current run counted ``my_run`` as rank ``my_rank`` of its group."""
    return (my_run is not None and head is not None and head.reachable and head.run is not None
            and head.group.get(my_rank) == my_run)


def undecided(v: NodeView) -> bool:
    """True for a node whose daemon has not yet decided about its engine: state ``stopped`` while
    the engine is wanted, which only a supervisor that has just started shows (a restart of
    sparkguard itself, before it has adopted the running engine or started another; a stop on
    purpose reads as not wanted).  Its next reading shows which; until then it breaks nothing."""
    return v.state == "stopped" and v.wanted and not v.given_up and v.run is None


def broken_group(group: dict[int, float], views: list[NodeView]) -> tuple[NodeView, str] | None:
    """The first rank of the head's ``group`` whose node now reports another run (or none): the
    group is broken.  Unreachable nodes decide nothing, nor do :func:`undecided` ones (a daemon
    restarting next to its running rank).  Returns ``(view, why)`` or None."""
    for v in views:
        if not v.reachable or v.role != "headless" or v.node_rank not in group:
            continue
        if undecided(v):
            continue
        if v.run != group[v.node_rank]:
            why = ("its rank is gone" if v.run is None else "its rank restarted") + f" ({v.state or '?'})"
            return v, why
    return None


class HeadWatch:
    """A headless rank's view of its head during one run.

    Args:
        rank: this node's rank; run: this run's id (its start, unix s).
    Feed each reading of the head with :meth:`see`; it returns what to do.
    """

    def __init__(self, rank: int, run: float):
        self.rank, self.run = rank, run
        self.joined: float | None = None           # the head run this run is in
        self.exposed: set[float] = set()           # head runs alive while this run waited outside them

    def see(self, head: NodeView | None) -> tuple[str | None, str]:
        """One reading of the head (None: no head among the reachable views).

        Returns ``(action, why)``: action None (carry on), ``"restart"`` (stop this run; a fresh
        one starts as soon as the head has no run) or ``"stop"`` (the head is stopped on purpose
        or has given up: stop this run; the order gate then holds the next start until the head
        wants to run again).  Both end the run with reason ``head``; the incident's cause says
        which (``wait``).
        """
        if head is None or not head.reachable or undecided(head):
            return None, ""
        if joined(self.rank, self.run, head):
            self.joined = head.run
            return None, ""
        if self.joined is not None:
            what = f"head {head.url}: the run this rank joined ({self.joined:.3f}) " + (
                f"was replaced by {head.run:.3f}" if head.run is not None else f"ended ({head.state or '?'})")
            self.joined = None
            return self._after_head(head, what)
        for old in list(self.exposed):
            if head.run != old:
                self.exposed.discard(old)
                return self._after_head(head, f"head {head.url}: its run {old:.3f} ended while this rank "
                                              "waited outside its group (a stale rendezvous)")
        if head.run is not None:
            self.exposed.add(head.run)
        return None, ""

    @staticmethod
    def _after_head(head: NodeView, what: str) -> tuple[str, str]:
        if head.given_up or not head.wanted:
            return "stop", what + ("; the head has given up" if head.given_up else "; the head is stopped on purpose")
        return "restart", what

"""The cluster file: read and validate ``/etc/sparkguard/cluster.yaml`` (the same file on every
node) into a :class:`~sparkguard.cluster.model.ClusterFile`.  One node's ``engine:`` section
derived from it is :mod:`.clusternode`'s (the final check here builds every node's with it).

It lives in the config package because ``config.load`` builds a node's configuration from it;
the operator's commands import it as :mod:`sparkguard.cluster.file`.

The format and its rules are in docs/cluster.md.  Every error is a
:class:`sparkguard.config.ConfigError` naming the cluster file, the dotted key (``nodes[2].addr``,
``engine.lanes.1m``) and the value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
from typing import Any

from sparkguard.cluster.model import ClusterFile, ClusterNode
from sparkguard.config.clusternode import node_engine
from sparkguard.config.engine import parse_lanes
from sparkguard.config.errors import ConfigError, NestedValueError
from sparkguard.config.parsers import abs_path, env_map, extra_args, int_range
from sparkguard.config.schema import SCHEMA, MetricsConfig
from sparkguard.config.yamlload import parse, read_bounded
from sparkguard.supervisor.cluster import flag_value   # the flag reader role_of uses: one reading of argv

DEFAULT_PATH = "/etc/sparkguard/cluster.yaml"
#: vLLM's default ``--master-port`` (vllm/config/parallel.py ``ParallelConfig.master_port``)
DEFAULT_MASTER_PORT = 29501
#: vLLM's default ``--port`` of ``vllm serve`` (vllm/entrypoints/openai/cli_args.py ``FrontendArgs.port``)
DEFAULT_API_PORT = 8000
#: every node's metrics port unless the file says otherwise: the port of sparkguard's default metrics.listen
DEFAULT_METRICS_PORT = MetricsConfig().listen[1]

#: the cluster's and the nodes' names: label-safe for Prometheus label values and file names
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
#: RFC 1123 host name label
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
#: ``[user@]host`` of an SSH destination: no whitespace, no leading '-' (ssh would read an option)
_SSH_DEST = re.compile(r"[^\s-][^\s]*\Z")
_SSH_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9]*=[^\s-][^\s]*\Z")
#: ssh options the operations always set (sparkguard.cluster.ssh): the file cannot weaken them
_SSH_FIXED = ("batchmode", "stricthostkeychecking")
#: the ssh_config(5) options ``ssh.options`` may set (lower case; ssh_config keywords are
#: case-insensitive).  None of them runs a command or changes which host keys are trusted:
#: UserKnownHostsFile / GlobalKnownHostsFile say where the trusted keys are read from, and with
#: StrictHostKeyChecking=yes (always given first) a host whose key is not in them is refused,
#: never added (ssh_config(5) StrictHostKeyChecking "yes": "never automatically add host keys
#: to the ~/.ssh/known_hosts file, and refuses to connect to hosts whose host key has changed").
#: Options that run local commands (ProxyCommand, LocalCommand, PermitLocalCommand,
#: KnownHostsCommand), that make another key count as the host's (HostKeyAlias) or that weaken
#: the fixed ones are not here.
_SSH_ALLOWED = {o.lower(): o for o in (
    "Port", "User", "IdentityFile", "IdentitiesOnly", "ConnectTimeout", "ServerAliveInterval",
    "ServerAliveCountMax", "ProxyJump", "UserKnownHostsFile", "GlobalKnownHostsFile", "LogLevel")}
#: LogLevel values that keep ssh's own error lines (sparkguard.cluster.ssh.ssh_failed reads them)
_SSH_LOGLEVELS = ("error", "info", "verbose")

#: the flags derived per node, in the order they are inserted (vLLM spells them with dashes and
#: also accepts underscores: FlexibleArgumentParser, vllm/utils/argparse_utils.py)
DERIVED_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless")
#: flags one node may not set on its own (``nodes[k].args``, ``nodes[k].lanes.*.args``): the API
#: address and port are the cluster's (the head's health URL, every rank's head URL are built
#: from them), the parallel sizes the whole group's (every rank must agree on the world size)
SHARED_FLAGS = ("--port", "--host", "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                "--data-parallel-size", "-dp")
#: ``--host`` values a shared command may give (besides none): a wildcard (every address, vLLM's
#: default is all of them: vllm/entrypoints/openai/cli_args.py ``FrontendArgs.host`` None)
_WILDCARD_HOSTS = ("0.0.0.0", "::")
#: engine keys the cluster file derives for every node; neither it nor a node's sparkguard.yaml sets them
DERIVED_KEYS = ("peers", "head_url", "health_url")
_TOP_KEYS = ("name", "metrics_port", "master_port", "ssh", "nodes", "engine")
_NODE_KEYS = ("name", "addr", "ssh", "rank", "metrics_port", "config", "env", "args", "lanes")

_port = int_range(1, 65535)


def load(path: str = DEFAULT_PATH) -> ClusterFile:
    """Read and validate the cluster file ``path``.

    Returns:
        ClusterFile, nodes in rank order.
    Raises:
        ConfigError: file missing, unreadable, over 1 MiB or not YAML; any invalid key (see
        :func:`from_dict`).
    """
    try:
        text = read_bounded(path)
    except FileNotFoundError:
        raise ConfigError(path, "(file)", None, "cluster file not found") from None
    return dataclasses.replace(from_dict(parse(text, path), path), digest=digest(text))


def digest(data: bytes) -> str:
    """The cluster file's digest: the first 12 hex digits of the SHA-256 of its bytes (48 bits:
    tells two versions of one file apart, it is no security check)."""
    return hashlib.sha256(data).hexdigest()[:12]


def from_dict(data: Any, path: str) -> ClusterFile:
    """Build a validated :class:`ClusterFile` from the parsed YAML ``data`` (named ``path`` in errors).

    Raises:
        ConfigError: an unknown or missing key, a bad value, fewer than 2 nodes, two nodes with
        one name, address or rank, a rank gap, a node's lane that is not a shared lane, a shared
        command without ``serve`` or with a flag derived per node, ranks (TP x PP) that cannot span
        the nodes.
    """
    if not isinstance(data, dict):
        raise ConfigError(path, "(top level)", data, "expected a mapping with " + ", ".join(_TOP_KEYS))
    for k, v in data.items():
        if k not in _TOP_KEYS:
            raise ConfigError(path, str(k), v, "unknown key; expected one of " + ", ".join(_TOP_KEYS))
    for k in ("name", "nodes", "engine"):
        if k not in data:
            raise ConfigError(path, k, None, "missing")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(path, "name", name, "expected 1-64 letters, digits, '_', '.' or '-'")
    metrics_port = _get(path, "metrics_port", data.get("metrics_port", DEFAULT_METRICS_PORT), _port)
    master_port = _get(path, "master_port", data.get("master_port", DEFAULT_MASTER_PORT), _port)
    ssh_options, remote = _ssh(path, data.get("ssh"))
    engine = _engine(path, data["engine"])
    nodes = _nodes(path, data["nodes"], metrics_port, engine)
    _check_ranks_span(path, "engine.command", engine["command"], len(nodes))
    cf = ClusterFile(path=path, name=name, nodes=nodes, engine=engine, master_port=master_port,
                     api_port=_api_port(path, engine["command"]), ssh_options=ssh_options,
                     remote_sparkguard=remote)
    _check_final(cf)
    return cf


def _check_final(cf: ClusterFile) -> None:
    """Every (node, lane)'s final argv (what that node runs in that lane: :func:`.clusternode.node_engine`'s
    command and lane args) spans the nodes, serves the API on :attr:`ClusterFile.api_port` and
    binds the API to no other host than the head's address or a wildcard.

    Raises:
        ConfigError: at ``engine.lanes.L.args`` (or ``engine.command``), naming the node and lane.
    """
    _check_host(cf, "engine.command", cf.engine["command"], "the shared command")
    for node in cf.nodes:
        e = node_engine(cf, node)
        lanes = e.get("lanes") or {}
        for lane in (lanes or {None: None}):
            argv = list(e["command"]) + (list((lanes[lane] or {}).get("args") or []) if lane else [])
            key = f"engine.lanes.{lane}.args" if lane else "engine.command"
            where = f"node {node.name}" + (f" in lane {lane}" if lane else "")
            _check_ranks_span(cf.path, key, argv, len(cf.nodes), where)
            port = _api_port(cf.path, argv, key)
            if port != cf.api_port:
                raise ConfigError(cf.path, key, f"--port {port}",
                                  f"{where} would serve on port {port}, the cluster's API port (engine.command "
                                  f"--port) is {cf.api_port}: the head's health URL is built from it")
            _check_host(cf, key, argv, where)


def _check_host(cf: ClusterFile, key: str, argv: list[str], where: str) -> None:
    """ConfigError when ``argv`` binds the API (``--host``) to another address than the head's
    or a wildcard: the head's health is read at its ``addr`` (:func:`.clusternode.head_health_url`)."""
    host = flag_value(_after_serve(argv), ("--host",))
    if host is not None and host not in _WILDCARD_HOSTS and normal_host(host) != normal_host(cf.head.addr):
        raise ConfigError(cf.path, key, f"--host {host}",
                          f"{where} would bind the API to {host}: give no --host, a wildcard (0.0.0.0, ::) "
                          f"or the head's addr ({cf.head.addr}), where health is read")


def _get(path: str, key: str, raw: Any, parser) -> Any:
    """``parser(raw)``; its ValueError (or NestedValueError below ``key``) as a ConfigError at ``key``."""
    try:
        return parser(raw)
    except NestedValueError as e:
        raise ConfigError(path, key + e.subkey, e.value, str(e)) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(path, key, raw, str(e)) from None


def _argv(path: str, key: str, raw: Any) -> tuple[str, ...]:
    """A list of non-empty strings (``ssh.command``)."""
    if not isinstance(raw, list) or not raw or not all(isinstance(x, str) and x for x in raw):
        raise ConfigError(path, key, raw, "expected a non-empty list of strings")
    return tuple(raw)


def _ssh(path: str, raw: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``ssh: {options: [K=V, ...], command: [argv]}`` -> (options, remote sparkguard command)."""
    if raw is None:
        return (), ("sparkguard",)
    if not isinstance(raw, dict):
        raise ConfigError(path, "ssh", raw, "expected a mapping with options and/or command")
    opts: tuple[str, ...] = ()
    remote: tuple[str, ...] = ("sparkguard",)
    for k, v in raw.items():
        if k == "options":
            if not isinstance(v, list):
                raise ConfigError(path, "ssh.options", v, "expected a list of KEY=VALUE ssh options")
            for i, o in enumerate(v):
                if not isinstance(o, str) or not _SSH_OPTION.match(o):
                    raise ConfigError(path, f"ssh.options[{i}]", o, "expected KEY=VALUE (ssh_config(5)), e.g. ConnectTimeout=5")
                key, value = o.split("=", 1)
                if key.lower() in _SSH_FIXED:
                    raise ConfigError(path, f"ssh.options[{i}]", o,
                                      "BatchMode=yes and StrictHostKeyChecking=yes are always set and cannot be changed")
                if key.lower() not in _SSH_ALLOWED:
                    raise ConfigError(path, f"ssh.options[{i}]", o,
                                      f"{key} is not allowed here; ssh.options may set "
                                      + ", ".join(_SSH_ALLOWED.values()))
                if key.lower() == "loglevel" and value.lower() not in _SSH_LOGLEVELS:
                    raise ConfigError(path, f"ssh.options[{i}]", o,
                                      "LogLevel must keep ssh's error lines: one of ERROR, INFO, VERBOSE")
            opts = tuple(v)
        elif k == "command":
            remote = _argv(path, "ssh.command", v)
        else:
            raise ConfigError(path, f"ssh.{k}", v, "unknown key; expected one of options, command")
    return opts, remote


def _is_flag(a: str, flag: str) -> bool:
    """``a`` is ``flag`` or ``flag=value``, with dashes or vLLM's underscores (a long flag's)."""
    a = a.split("=", 1)[0]
    return a == flag or (flag.startswith("--") and a == "--" + flag[2:].replace("-", "_"))


def _derived_in(path: str, key: str, argv: tuple[str, ...]) -> None:
    """ConfigError when ``argv`` carries one of :data:`DERIVED_FLAGS`."""
    for a in argv:
        for f in DERIVED_FLAGS:
            if _is_flag(a, f):
                raise ConfigError(path, key, a, f"{f} is derived for each node from the cluster file's nodes; remove it")


def _shared_in(path: str, key: str, argv: tuple[str, ...]) -> None:
    """ConfigError when one node's ``argv`` carries one of :data:`SHARED_FLAGS`."""
    for a in argv:
        for f in SHARED_FLAGS:
            if _is_flag(a, f):
                raise ConfigError(path, key, a, f"{f} is the whole cluster's (engine.command or a shared lane), "
                                  "not one node's; remove it")


def _engine(path: str, raw: Any) -> dict:
    """The shared ``engine:`` mapping, every key validated by the config's own parser (SCHEMA);
    returned raw (as written), for each node's config to be built from."""
    if not isinstance(raw, dict):
        raise ConfigError(path, "engine", raw, "expected a mapping of engine keys (the engine: section's)")
    parsers = SCHEMA["engine"][1]
    parsed = {}
    for k, v in raw.items():
        if k in DERIVED_KEYS:
            raise ConfigError(path, f"engine.{k}", v, "derived for each node from the cluster file's nodes; remove it")
        if k not in parsers:
            raise ConfigError(path, f"engine.{k}", v, "unknown key; expected one of "
                              + ", ".join(p for p in parsers if p not in DERIVED_KEYS))
        parsed[k] = _get(path, f"engine.{k}", v, parsers[k])
    command = parsed.get("command")
    if command is None:
        raise ConfigError(path, "engine.command", None, "missing: a cluster runs one engine over its nodes")
    if "serve" not in command:
        raise ConfigError(path, "engine.command", list(command),
                          "lacks serve: expected a vLLM command such as [vllm, serve, MODEL, ...]")
    _derived_in(path, "engine.command", command)
    lanes = parsed.get("lanes") or {}
    for lane, body in lanes.items():
        _derived_in(path, f"engine.lanes.{lane}.args", body.args)
    lane = parsed.get("lane")
    if lane is not None and lane not in lanes:
        raise ConfigError(path, "engine.lane", lane, "no such lane; engine.lanes has " + (", ".join(lanes) or "none"))
    out = dict(raw)
    out["command"] = list(command)
    return out


def _addr(v: Any) -> str:
    """An IP address or an RFC 1123 host name, as written."""
    if isinstance(v, str):
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            labels = v.split(".")
            # a last label of digits only is a mistyped IPv4 address, no host name (RFC 3696 section 2)
            if len(v) <= 253 and all(_LABEL.match(x) for x in labels) and not labels[-1].isdigit():
                return v
    raise ValueError("expected an IP address or a host name")


def _ssh_dest(v: Any) -> str:
    """An SSH destination ``[user@]host``: ssh would read one starting with '-' as an option."""
    if not isinstance(v, str) or not _SSH_DEST.match(v):
        raise ValueError("expected an SSH destination [user@]host (no spaces, not starting with '-')")
    return v


def _node_name(v: Any) -> str:
    """A node's name: label-safe, and not starting with '-' (it is the default SSH destination)."""
    if not isinstance(v, str) or not _NAME.match(v) or v.startswith("-"):
        raise ValueError("expected 1-64 letters, digits, '_', '.' or '-', not starting with '-' (the node's hostname)")
    return v


def normal_host(host: str) -> str:
    """``host`` compared as the same machine: an IP literal in its canonical form
    (``ipaddress.ip_address``: ``10.0.0.01``-style spellings are refused by it, ``::0:1`` becomes
    ``::1``), a host name in lower case without a trailing dot (RFC 4343: DNS names are
    case-insensitive)."""
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        return h.lower().rstrip(".")


def ssh_host(dest: str) -> str:
    """The host part of an SSH destination ``[user@]host``, normalised (:func:`normal_host`)."""
    return normal_host(dest.rsplit("@", 1)[-1])


def _nodes(path: str, raw: Any, metrics_port: int, engine: dict) -> tuple[ClusterNode, ...]:
    """``nodes:`` -> ClusterNodes sorted by rank; ranks given for every node or for none."""
    if not isinstance(raw, list) or len(raw) < 2:
        raise ConfigError(path, "nodes", raw, "expected a list of at least 2 nodes (a cluster has 2 or more)")
    shared_lanes = tuple((engine.get("lanes") or {}).keys())
    parsers = {"name": _node_name, "addr": _addr, "ssh": _ssh_dest, "rank": int_range(0, 1023),
               "metrics_port": _port, "config": abs_path, "env": env_map, "args": extra_args, "lanes": parse_lanes}
    nodes: list[dict] = []
    for i, body in enumerate(raw):
        key = f"nodes[{i}]"
        if not isinstance(body, dict):
            raise ConfigError(path, key, body, "expected a mapping with name, addr, ...")
        vals = {}
        for k, v in body.items():
            if k not in _NODE_KEYS:
                raise ConfigError(path, f"{key}.{k}", v, "unknown key; expected one of " + ", ".join(_NODE_KEYS))
            vals[k] = _get(path, f"{key}.{k}", v, parsers[k])
        for k in ("name", "addr"):
            if k not in vals:
                raise ConfigError(path, f"{key}.{k}", None, "missing")
        _derived_in(path, f"{key}.args", vals.get("args", ()))
        _shared_in(path, f"{key}.args", vals.get("args", ()))
        for lane, body_l in (vals.get("lanes") or {}).items():
            if lane not in shared_lanes:
                raise ConfigError(path, f"{key}.lanes.{lane}", body.get("lanes", {}).get(lane),
                                  f"a lane that not every node has: node {vals['name']} adds to lane {lane}, which "
                                  f"engine.lanes does not define (it has {', '.join(shared_lanes) or 'none'})")
            _derived_in(path, f"{key}.lanes.{lane}.args", body_l.args)
            _shared_in(path, f"{key}.lanes.{lane}.args", body_l.args)
        if "ssh" not in vals:           # the default destination is the node's name: checked as one
            vals["ssh"] = _get(path, f"{key}.name", vals["name"], _ssh_dest)
        nodes.append(vals)
    _unique(path, nodes, "name")
    _unique(path, nodes, "addr", normal_host)
    _unique(path, nodes, "ssh", ssh_host)
    ranked = [k for k, n in enumerate(nodes) if "rank" in n]
    if ranked and len(ranked) != len(nodes):
        k = next(k for k, n in enumerate(nodes) if "rank" not in n)
        raise ConfigError(path, f"nodes[{k}].rank", None,
                          f"missing: node {nodes[k]['name']} has no rank while node {nodes[ranked[0]]['name']} has "
                          "one; give every node its rank, or none (then the list order is the rank order)")
    if ranked:
        claimed: dict[int, int] = {}
        for k, n in enumerate(nodes):
            if n["rank"] in claimed:
                j = claimed[n["rank"]]
                raise ConfigError(path, f"nodes[{k}].rank", n["rank"],
                                  f"two nodes claiming one rank: {nodes[j]['name']} and {n['name']} both claim "
                                  f"rank {n['rank']}")
            claimed[n["rank"]] = k
        missing = [r for r in range(len(nodes)) if r not in claimed]
        if missing:                 # N distinct ranks with one missing: some node's is N or more
            k = next(k for k, n in enumerate(nodes) if n["rank"] >= len(nodes))
            raise ConfigError(path, f"nodes[{k}].rank", nodes[k]["rank"],
                              f"a rank gap: rank {missing[0]} is missing (the ranks of {len(nodes)} nodes "
                              f"are 0..{len(nodes) - 1}, each once)")
    else:
        for k, n in enumerate(nodes):
            n["rank"] = k
    nodes.sort(key=lambda n: n["rank"])
    return tuple(ClusterNode(name=n["name"], rank=n["rank"], addr=n["addr"], ssh=n["ssh"],
                             metrics_port=n.get("metrics_port", metrics_port), env=n.get("env", {}),
                             args=n.get("args", ()), lanes=n.get("lanes", {}), config=n.get("config"))
                 for n in nodes)


def _unique(path: str, nodes: list[dict], key: str, norm=lambda v: v) -> None:
    """ConfigError when two nodes' ``key`` are the same after ``norm`` (two spellings of one host
    are one host: two nodes reached at one SSH destination would run every command twice on one
    machine and never on the other)."""
    seen: dict[str, int] = {}
    for k, n in enumerate(nodes):
        v = norm(n[key])
        if v in seen:
            j = seen[v]
            same = "" if n[key] == nodes[j][key] else f" ({nodes[j][key]!r} and {n[key]!r} are one host)"
            raise ConfigError(path, f"nodes[{k}].{key}", n[key],
                              f"given twice: nodes[{j}] ({nodes[j]['name']}) and nodes[{k}] ({n['name']}){same}")
        seen[v] = k


def _after_serve(argv: list[str] | tuple[str, ...]) -> list[str]:
    return list(argv[list(argv).index("serve") + 1:])


def _int_flag(path: str, argv: list[str], names: tuple[str, ...], default: int, key: str = "engine.command") -> int:
    v = flag_value(argv, names)
    if v is None:
        return default
    if not v.isdigit() or int(v) < 1:
        raise ConfigError(path, key, f"{names[0]} {v}", "expected a whole number of at least 1")
    return int(v)


def _check_ranks_span(path: str, key: str, command: list[str], n: int, where: str = "") -> None:
    """The engine's ranks (``command``'s, a node's final argv; ConfigError at ``key``, naming
    ``where`` when given) spread evenly over the ``n`` nodes.

    Source: vllm/config/parallel.py ``ParallelConfig``: ``world_size`` "is TPxPP" and, without data
    parallelism, ``local_world_size = world_size // nnodes``: the ranks each node starts.
    Assumption (no check of it read in vLLM): a world size that is not a multiple of ``--nnodes``
    leaves ranks that no node starts (the division floors), so the group would never form; it
    is refused here, before minutes of loading.
    """
    args = _after_serve(command)
    tp = _int_flag(path, args, ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"), 1, key)
    pp = _int_flag(path, args, ("--pipeline-parallel-size", "--pipeline_parallel_size", "-pp"), 1, key)
    if (tp * pp) % n:
        raise ConfigError(path, key, f"--tensor-parallel-size {tp}" + (f" --pipeline-parallel-size {pp}"
                          if pp != 1 else ""),
                          f"{tp * pp} rank(s) (tensor-parallel x pipeline-parallel) cannot span {n} nodes"
                          + (f" ({where})" if where else "")
                          + f": --tensor-parallel-size must make it a multiple of {n}")


def _api_port(path: str, command: list[str], key: str = "engine.command") -> int:
    """The command's ``--port`` (vLLM's default 8000 without one).  ConfigError at ``key``."""
    v = flag_value(_after_serve(command), ("--port",))
    if v is None:
        return DEFAULT_API_PORT
    try:
        return _port(int(v) if v.isdigit() else v)
    except ValueError:
        raise ConfigError(path, key, f"--port {v}", "expected a port 1-65535") from None

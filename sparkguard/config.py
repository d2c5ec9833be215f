"""Configuration: schema, embedded defaults, loading and validation.

The file is YAML, default path ``/etc/sparkguard/sparkguard.yaml``; when it is absent
the embedded defaults apply.  Every error names the file, the dotted key and the value
(:class:`ConfigError`), so that ``sparkguard run`` refuses to start and a SIGHUP reload
keeps the running configuration.

Sections and keys (see README "Configuration"):

* ``guard``: ``poll_interval``, ``term_below``, ``kill_below``, ``grace``, ``signal``,
  ``dry_run``, ``recovery_wait``
* ``targets``: ``match``, ``protect``, ``fallback``
* ``metrics``: ``listen``
* ``incidents``: ``dir``, ``journal``
* ``engine`` (optional; absent = guard only): ``command``, ``env``, ``cwd``, ``user``, lifecycle,
  gates, health, probe, restart policy, lanes, control socket, peers, head (see :class:`EngineConfig`)
* ``link``: ``interfaces``, ``down_after``, ``mark_unhealthy``

Numbers are read as the decimal the user wrote or refused (:func:`_loader`, sparkguard.units):
NaN, infinities, ``1e400``, octal ``010``, ``0x10``, ``1_000``, sexagesimal ``1:30`` and dates
never become another value; each numeric key has bounds (SCHEMA) that keep the poll loop sane.
The file itself must be a regular file of at most :data:`MAX_FILE_BYTES`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

from sparkguard.units import parse_duration, parse_size, refuse_yaml11_number

DEFAULT_PATH = "/etc/sparkguard/sparkguard.yaml"
MAX_FILE_BYTES = 1024**2     # a config is a few KiB; more is the wrong file (/dev/zero, a log)

#: Default target patterns (Python regexes, ``re.search`` against the NUL->space joined
#: /proc/PID/cmdline, which for setproctitle'd processes is the title alone).  Order is
#: priority.  Sources: vLLM 0.x ``vllm/utils`` ``bind_process_name`` / setproctitle calls
#: (``VLLM::EngineCore``, ``VLLM::Worker_TP0``), SGLang ``sglang::scheduler_TP0``, Ray
#: actor titles ``ray::RayWorkerWrapper``.
DEFAULT_MATCH = [
    r"(^|[/\s])vllm\s+serve(\s|$)",
    r"-m\s+vllm\.entrypoints\.",
    r"^VLLM::",
    r"^sglang::",
    r"-m\s+sglang\.launch_server",
    r"(^|/)tritonserver(\s|$)",
    r"^ray::RayWorker",
]

#: Processes never signalled: regexes ``fullmatch``ed against /proc/PID/comm and against
#: the basename of argv[0].
DEFAULT_PROTECT = [
    r"sshd.*", r"systemd", r"systemd-.*", r"(init|agetty|login)", r"dbus-(daemon|broker)",
    r"journald", r"rsyslogd", r"sparkguard", r"Xorg", r"containerd.*", r"dockerd",
    r"nvidia-persistenced", r"nv-hostengine",
]


class ConfigError(ValueError):
    """A configuration value is wrong.

    Attributes:
        path: str, the file (or ``"<defaults>"``).
        key: str, dotted key such as ``"guard.grace"``.
        value: the offending value as read.
        reason: str, what is wrong and what is expected.
    """

    def __init__(self, path: str, key: str, value: Any, reason: str):
        self.path, self.key, self.value, self.reason = path, key, value, reason
        if key.startswith("("):        # (file), (syntax): no value to show
            super().__init__(f"{path}: {reason}")
        else:
            super().__init__(f"{path}: {key}: {_show(value)}: {reason}")


def _show(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; an int too long for repr (Python >= 3.11 refuses
    more than 4300 digits) is shown by its size."""
    try:
        text = repr(value)
    except ValueError:
        return f"<a number of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class GuardConfig:
    """``guard:``.  Sizes in bytes, durations in seconds."""

    poll_interval: float = 0.2
    term_below: int = int(0.75 * 1024**3)
    kill_below: int | None = None
    # grace: measured on an NVIDIA H200 (bench/cuda_guard.py, README "Drill and benchmarks"): a
    # PyTorch+Triton process holding 40.6 GiB of GPU memory and 8 GiB of pinned host memory exits
    # 1.0-1.8 s after SIGTERM (with or without a handler that tears CUDA down) or SIGKILL, i.e. at
    # most ~37 ms per GiB held.  Scaled to the 121.7 GiB a DGX Spark can hold: ~4.5 s.  A process
    # that needs longer is blocked in a CUDA call (its handler ran 9.3 s late behind a 12 s kernel),
    # where waiting does not help while memory keeps falling.  Hence 5 s.
    grace: float = 5.0
    signal: str = "available"          # "available" | "available+swap"
    dry_run: bool = False
    recovery_wait: float = 10.0


@dataclass(frozen=True)
class TargetsConfig:
    """``targets:``.  ``match`` and ``protect`` are tuples of regex strings."""

    match: tuple[str, ...] = tuple(DEFAULT_MATCH)
    protect: tuple[str, ...] = tuple(DEFAULT_PROTECT)
    fallback: str = "off"              # "off" | "oom_score"


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics:``.  ``listen`` is ``(host, port)`` or None when off."""

    listen: tuple[str, int] | None = ("127.0.0.1", 8799)


@dataclass(frozen=True)
class IncidentsConfig:
    """``incidents:``."""

    dir: str = "/var/lib/sparkguard/incidents"
    journal: str = "auto"              # "auto" | "on" | "off"


@dataclass(frozen=True)
class ProbeConfig:
    """``engine.probe``: the liveness probe, a real one-token completion.

    ``url`` None means ``<health_url's scheme://host:port>/v1/completions``; ``model`` None means
    the first id that ``GET /v1/models`` lists.  Durations in seconds.
    """

    url: str | None = None
    model: str | None = None
    interval: float = 30.0
    timeout: float = 20.0
    failures: int = 3


@dataclass(frozen=True)
class LaneConfig:
    """One entry of ``engine.lanes``: extra ``args`` appended to ``engine.command`` and extra ``env``."""

    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineConfig:
    """``engine:``, the engine sparkguard starts and supervises (issue #5).

    ``command`` None means no engine: sparkguard only guards.  Sizes in bytes, durations in
    seconds.  ``shutdown_timeout`` None means: for a vLLM command, derived from ``guard.grace``
    (see :func:`vllm_shutdown_timeout`); ``lane`` None with ``lanes`` means the first lane.
    """

    command: tuple[str, ...] | None = None
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    identifier: str | None = None
    log: str = "auto"                  # "auto" | "journal" | "stderr"
    journal_socket: str = "/run/systemd/journal/socket"
    log_lines: int = 200
    drop_caches: bool = True
    start_above: int = 4 * 1024**3
    stable_for: float = 5.0
    stable_band: int = 256 * 1024**2
    quiesce_timeout: float = 300.0
    health_url: str | None = None
    health_interval: float = 2.0
    ready_timeout: float = 1200.0
    probe: ProbeConfig | None = None
    restart: str = "always"            # "always" | "on-failure" | "never"
    backoff_initial: float = 1.0
    backoff_max: float = 300.0
    stable_after: float = 600.0
    shutdown_timeout: float | None = None
    lanes: dict = field(default_factory=dict)
    lane: str | None = None
    state_file: str = "/var/lib/sparkguard/engine-state.json"
    control_socket: str = "/run/sparkguard/control.sock"
    peers: tuple[str, ...] = ()
    head_url: str | None = None
    head_lost_after: float = 60.0

    @property
    def enabled(self) -> bool:
        """True when an engine command is configured."""
        return self.command is not None


@dataclass(frozen=True)
class LinkConfig:
    """``link:``: the TP fabric interfaces watched through netlink (see sparkguard.linkwatch).

    ``interfaces`` is a tuple of interface names; empty (the default) turns the watch off
    and pyroute2 is never imported.  ``down_after`` is seconds a link must stay down before
    it is an incident.  ``mark_unhealthy``: a link incident also marks the supervised
    engine unhealthy, so that it is restarted once the link is back.
    """

    interfaces: tuple[str, ...] = ()
    down_after: float = 5.0
    mark_unhealthy: bool = False


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``path`` is where it came from (``"<defaults>"`` if embedded)."""

    guard: GuardConfig = field(default_factory=GuardConfig)
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    incidents: IncidentsConfig = field(default_factory=IncidentsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    path: str = "<defaults>"


# --- value parsers: each takes the raw YAML value and returns the typed value or raises ValueError


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError("expected true or false")


MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
MIN_TICK = 0.01             # seconds: the shortest period of anything that repeats (no busy loop)
MAX_SIZE = 1024**5          # bytes (1 PiB): far above any machine's RAM, far below overflow


def _secs(x: float) -> str:
    """Seconds as a config duration: ``_secs(0.01) == "10ms"``, ``_secs(3600) == "1h"``."""
    for unit, n in (("d", DAY), ("h", HOUR), ("m", MINUTE), ("s", 1.0)):
        if x >= n and x % n == 0:
            return f"{x / n:g}{unit}" if unit != "d" else f"{x / HOUR:g}h"
    return f"{x * 1000:g}ms"


def _duration(lo: float, hi: float) -> Callable[[Any], float]:
    """Parser of a duration in seconds from ``lo`` to ``hi`` (inclusive); ValueError outside."""
    def parse(v: Any) -> float:
        d = parse_duration(v)
        if not lo <= d <= hi:
            raise ValueError(f"must be from {_secs(lo) if lo else '0'} to {_secs(hi)}")
        return d
    return parse


def _size(v: Any) -> int:
    """A size in bytes from 0 to :data:`MAX_SIZE`."""
    n = parse_size(v)
    if n > MAX_SIZE:
        raise ValueError("must be at most 1024TiB")
    return n


MIN_LINE = 16 * 1024**2   # bytes; a line lower than this cannot save the box


def _line_size(v: Any) -> int:
    """A threshold: a size from 16 MiB to 1 PiB; a small bare number is taken for a unit slip."""
    n = _size(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and n < MIN_LINE:
        raise ValueError(f"a bare number is bytes; did you mean {v}GiB?")
    if n < MIN_LINE:
        raise ValueError("must be at least 16MiB: a lower line cannot act before the kernel livelocks")
    return n


def _optional_size(v: Any) -> int | None:
    if v is None or v is False or (isinstance(v, str) and v.lower() in ("off", "none")):
        return None
    return _line_size(v)


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        # YAML 1.1 reads a bare off/on/no/yes as a bool: take it as the word the user wrote
        if isinstance(v, bool):
            v = "on" if v else "off"
        if v not in choices:
            raise ValueError("expected one of " + ", ".join(choices))
        return v
    return parse


def _regex_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of regular expressions (strings)")
    for x in v:
        try:
            re.compile(x)
        except re.error as e:
            raise ValueError(f"bad regular expression {x!r}: {e}") from None
    return tuple(v)


def _listen(v: Any) -> tuple[str, int] | None:
    if v is None or v is False or (isinstance(v, str) and v.lower() == "off"):
        return None
    if not isinstance(v, str) or ":" not in v:
        raise ValueError("expected host:port such as 127.0.0.1:8799, or off")
    host, _, port = v.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("port must be 1-65535")
    return (host or "127.0.0.1", int(port))


def _ifname_list(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of interface names such as [enp1s0f0np0]")
    for x in v:
        # net/core/dev.c dev_valid_name: 1-15 bytes, no '/', ':' or whitespace, not '.' or '..'
        if not 0 < len(x.encode()) < 16 or x in (".", "..") or any(c in x for c in "/: \t\n"):
            raise ValueError(f"{x!r} is not a valid interface name (1-15 characters, no '/', ':' or spaces)")
    if len(set(v)) != len(v):
        raise ValueError("an interface is listed twice")
    return tuple(v)


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("expected a path")
    if not os.path.isabs(v):
        raise ValueError("expected an absolute path (the daemon's working directory is /)")
    return v


class NestedValueError(ValueError):
    """A ValueError about a value nested below the key being parsed (``engine.lanes.big.args``).

    Attributes:
        subkey: str appended to the dotted key, e.g. ``".big.args"``.
        value: the offending nested value.
    """

    def __init__(self, subkey: str, value: Any, reason: str):
        super().__init__(reason)
        self.subkey, self.value = subkey, value


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _argv(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ValueError("expected a non-empty list of strings (argv), e.g. [vllm, serve, MODEL]")
    return tuple(v)


def _args(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v):
        raise ValueError("expected a list of strings (extra argv)")
    return tuple(_as_written(x) for x in v)


def _as_written(x: str | int | float) -> str:
    """A scalar as the file spells it: a float keeps its text (``1e3``, not ``1000.0``)."""
    return getattr(x, "text", None) or str(x)


def _env(v: Any) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("expected a mapping NAME: value")
    out = {}
    for k, x in v.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise NestedValueError(f".{k}", x, "not a valid environment variable name")
        if isinstance(x, bool) or not isinstance(x, (str, int, float)):
            raise NestedValueError(f".{k}", x, "expected a string or number")
        out[k] = _as_written(x)
    return out


def _optional_str(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError("expected a non-empty string")
    return v


def _user(v: Any) -> str | None:
    import pwd
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError("expected a user name or uid")
    try:
        pwd.getpwuid(v) if isinstance(v, int) else pwd.getpwnam(v)
    except (KeyError, OverflowError, ValueError):   # OverflowError: a uid out of uid_t's range
        raise ValueError("no such user on this machine") from None
    return str(v)


def _http_url(v: Any) -> str:
    from urllib.parse import urlsplit
    if not isinstance(v, str) or not v:
        raise ValueError("expected an http:// URL")
    u = urlsplit(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    try:
        u.port
    except ValueError:
        raise ValueError("bad port in URL") from None
    return v


def _optional_url(v: Any) -> str | None:
    return None if v is None else _http_url(v)


def _url_list(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ValueError("expected a list of URLs (the other nodes' sparkguard metrics endpoints)")
    out = []
    for i, x in enumerate(v):
        try:
            out.append(_http_url(x))
        except ValueError as e:
            raise NestedValueError(f"[{i}]", x, str(e)) from None
    return tuple(out)


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, str):
            refuse_yaml11_number(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"expected a whole number from {lo} to {hi}")
        return v
    return parse


_PROBE_KEYS: dict[str, Callable[[Any], Any]] = {
    "url": _optional_url, "model": _optional_str, "interval": _duration(MIN_TICK, DAY),
    "timeout": _duration(MIN_TICK, HOUR), "failures": _int_range(1, 1000),
}


def _probe(v: Any) -> ProbeConfig | None:
    if v is None or v is False or (isinstance(v, str) and v.lower() == "off"):
        return None
    if v is True or (isinstance(v, str) and v.lower() == "on"):
        return ProbeConfig()
    if not isinstance(v, dict):
        raise ValueError("expected off, on, or a mapping with " + ", ".join(_PROBE_KEYS))
    vals = {}
    for k, x in v.items():
        if k not in _PROBE_KEYS:
            raise NestedValueError(f".{k}", x, "unknown key; expected one of " + ", ".join(_PROBE_KEYS))
        try:
            vals[k] = _PROBE_KEYS[k](x)
        except NestedValueError:
            raise
        except ValueError as e:
            raise NestedValueError(f".{k}", x, str(e)) from None
    return ProbeConfig(**vals)


_LANE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def _lanes(v: Any) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("expected a mapping NAME: {args: [...], env: {...}}")
    out = {}
    for name, body in v.items():
        if not isinstance(name, str) or not _LANE_NAME.match(name):
            raise NestedValueError(f".{name}", body, "lane names are 1-64 letters, digits, '.', '_' or '-'")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise NestedValueError(f".{name}", body, "expected a mapping with args and/or env")
        vals = {}
        for k, x in body.items():
            parser = {"args": _args, "env": _env}.get(k)
            if parser is None:
                raise NestedValueError(f".{name}.{k}", x, "unknown key; expected one of args, env")
            try:
                vals[k] = parser(x)
            except NestedValueError as e:
                raise NestedValueError(f".{name}.{k}{e.subkey}", e.value, str(e)) from None
            except ValueError as e:
                raise NestedValueError(f".{name}.{k}", x, str(e)) from None
        out[name] = LaneConfig(**vals)
    return out


def _lane_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not _LANE_NAME.match(v):
        raise ValueError("expected the name of one of engine.lanes")
    return v


#: section -> (dataclass, {key: parser}).  Bounds (README "Configuration"): anything that repeats
#: (poll_interval, health_interval, probe.interval) at least MIN_TICK, so no loop spins; every duration
#: below a day (an hour for the guard's own timers), sizes at most 1 PiB, so no timeout overflows
#: poll(2)'s int milliseconds or threading.TIMEOUT_MAX and SIGKILL always comes.
SCHEMA: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
    "guard": (GuardConfig, {
        "poll_interval": _duration(MIN_TICK, 10.0),      # 10 s: memory can fall several GiB/s
        "term_below": _line_size,
        "kill_below": _optional_size,
        "grace": _duration(0.0, HOUR),
        "signal": _choice("available", "available+swap"),
        "dry_run": _bool,
        "recovery_wait": _duration(0.0, HOUR),
    }),
    "targets": (TargetsConfig, {
        "match": _regex_list,
        "protect": _regex_list,
        "fallback": _choice("off", "oom_score"),
    }),
    "metrics": (MetricsConfig, {"listen": _listen}),
    "incidents": (IncidentsConfig, {"dir": _path, "journal": _choice("auto", "on", "off")}),
    "engine": (EngineConfig, {
        "command": _argv,
        "env": _env,
        "cwd": _optional_str,
        "user": _user,
        "identifier": _optional_str,
        "log": _choice("auto", "journal", "stderr"),
        "journal_socket": _path,
        "log_lines": _int_range(1, 100000),
        "drop_caches": _bool,
        "start_above": _size,
        "stable_for": _duration(0.0, HOUR),
        "stable_band": _size,
        "quiesce_timeout": _duration(0.0, DAY),
        "health_url": _optional_url,
        "health_interval": _duration(MIN_TICK, HOUR),
        "ready_timeout": _duration(MIN_TICK, DAY),
        "probe": _probe,
        "restart": _choice("always", "on-failure", "never"),
        "backoff_initial": _duration(0.0, DAY),
        "backoff_max": _duration(0.0, DAY),
        "stable_after": _duration(MIN_TICK, 7 * DAY),
        "shutdown_timeout": lambda v: None if v is None else _duration(0.0, HOUR)(v),
        "lanes": _lanes,
        "lane": _lane_name,
        "state_file": _path,
        "control_socket": _path,
        "peers": _url_list,
        "head_url": _optional_url,
        "head_lost_after": _duration(MIN_TICK, DAY),
    }),
    "link": (LinkConfig, {
        "interfaces": _ifname_list,
        "down_after": _duration(0.0, DAY),
        "mark_unhealthy": _bool,
    }),
}


def _mem_total() -> int | None:
    from sparkguard.sysinfo import read_meminfo
    try:
        return read_meminfo().get("MemTotal")
    except OSError:
        return None


def from_dict(data: Any, path: str = "<defaults>", mem_total: int | None = None) -> Config:
    """Build a validated :class:`Config` from parsed YAML.

    Args:
        data: the parsed document (a mapping, or None for an empty file).
        path: file name used in error messages.
        mem_total: MemTotal in bytes for the ``term_below`` check; read from /proc/meminfo if None.
    Returns:
        Config.
    Raises:
        ConfigError: unknown section or key, wrong type, or impossible value.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, "(top level)", data, "expected a mapping of sections: " + ", ".join(SCHEMA))
    sections: dict[str, Any] = {}
    for name, body in data.items():
        if name not in SCHEMA:
            raise ConfigError(path, str(name), body, "unknown section; expected one of " + ", ".join(SCHEMA))
        cls, parsers = SCHEMA[name]
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(path, name, body, "expected a mapping of keys")
        values = {}
        for key, raw in body.items():
            if key not in parsers:
                raise ConfigError(path, f"{name}.{key}", raw,
                                  "unknown key; expected one of " + ", ".join(parsers))
            try:
                values[key] = parsers[key](raw)
            except NestedValueError as e:
                raise ConfigError(path, f"{name}.{key}{e.subkey}", e.value, str(e)) from None
            except (ValueError, TypeError, OverflowError) as e:   # a YAML type a parser did not expect
                raise ConfigError(path, f"{name}.{key}", raw, str(e)) from None
        sections[name] = cls(**values)
    cfg = Config(path=path, **sections)
    _check(cfg, data, path, mem_total)
    return cfg


def _raw(data: dict, dotted: str) -> Any:
    sec, _, key = dotted.partition(".")
    body = data.get(sec) or {}
    return body.get(key, getattr(getattr(Config(), sec), key))


def _check(cfg: Config, data: dict, path: str, mem_total: int | None) -> None:
    g = cfg.guard
    total = mem_total if mem_total is not None else _mem_total()
    if g.term_below <= 0:
        raise ConfigError(path, "guard.term_below", _raw(data, "guard.term_below"), "must be greater than 0")
    if total is not None and g.term_below >= total:
        raise ConfigError(path, "guard.term_below", _raw(data, "guard.term_below"),
                          f"is not below MemTotal ({total} bytes)")
    if g.kill_below is not None and g.kill_below > g.term_below:
        raise ConfigError(path, "guard.kill_below", _raw(data, "guard.kill_below"),
                          f"is above guard.term_below ({g.term_below} bytes); the KILL floor must be lower")
    if not cfg.targets.match and cfg.targets.fallback == "off":
        raise ConfigError(path, "targets.match", [], "empty with targets.fallback off: nothing could ever be signalled")
    _check_engine(cfg, data, path, total)


SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def is_vllm(argv: tuple[str, ...] | list[str] | None) -> bool:
    """True if ``argv`` starts vLLM: ``vllm serve ...`` (any path to a ``vllm`` script, also run
    by a python interpreter) or ``python -m vllm.entrypoints...``."""
    if not argv:
        return False
    head = list(argv[:4])
    for i, a in enumerate(head):
        if os.path.basename(a) == "vllm" and i < 3:
            return True
        if a == "-m" and i + 1 < len(head) and head[i + 1].split(".")[0] == "vllm":
            return True
    return False


def vllm_shutdown_timeout(grace: float) -> int:
    """Seconds to give vLLM's workers after SIGTERM (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) so that
    they tear CUDA down before the guard's SIGKILL: ``grace - max(2, grace/5)``, floored, >= 0.

    Source: FIELD-NOTES "vLLM" (default 0 on CUDA = workers SIGKILLed within milliseconds).
    """
    return int(max(0.0, grace - max(2.0, 0.2 * grace)))


def _shutdown_values(e: EngineConfig) -> list[tuple[str, Any]]:
    """Every shutdown timeout the engine could be given, as (dotted key, raw value)."""
    out: list[tuple[str, Any]] = []
    if e.shutdown_timeout is not None:
        out.append(("engine.shutdown_timeout", e.shutdown_timeout))
    if SHUTDOWN_ENV in e.env:
        out.append((f"engine.env.{SHUTDOWN_ENV}", e.env[SHUTDOWN_ENV]))
    argvs = [("engine.command", e.command or ())] + [(f"engine.lanes.{n}.args", ln.args) for n, ln in e.lanes.items()]
    for name, lane in e.lanes.items():
        if SHUTDOWN_ENV in lane.env:
            out.append((f"engine.lanes.{name}.env.{SHUTDOWN_ENV}", lane.env[SHUTDOWN_ENV]))
    for key, argv in argvs:
        for i, a in enumerate(argv):
            if a == "--shutdown-timeout" and i + 1 < len(argv):
                out.append((key, argv[i + 1]))
            elif a.startswith("--shutdown-timeout="):
                out.append((key, a.split("=", 1)[1]))
    return out


def _check_engine(cfg: Config, data: dict, path: str, total: int | None) -> None:
    e = cfg.engine
    body = data.get("engine") or {}
    if e.command is None:
        # a guard-only file may spell out the defaults (sparkguard install does); anything else needs a command
        default = EngineConfig()
        other = next((k for k in body if k != "command" and getattr(e, k) != getattr(default, k)), None)
        if other is not None:
            raise ConfigError(path, "engine.command", None,
                              f"missing: engine.{other} is set but there is no command to start")
        return
    if e.lane is not None and e.lane not in e.lanes:
        raise ConfigError(path, "engine.lane", e.lane,
                          "no such lane; engine.lanes has " + (", ".join(e.lanes) or "none"))
    if e.cwd is not None and not os.path.isdir(e.cwd):
        raise ConfigError(path, "engine.cwd", e.cwd, "not an existing directory")
    if total is not None and e.start_above >= total:
        raise ConfigError(path, "engine.start_above", body.get("start_above"),
                          f"is not below MemTotal ({total} bytes): the engine could never start")
    if e.backoff_max < e.backoff_initial:
        raise ConfigError(path, "engine.backoff_max", body.get("backoff_max"),
                          f"is below engine.backoff_initial ({e.backoff_initial:g} s)")
    if e.probe is not None and e.probe.url is None and e.health_url is None:
        raise ConfigError(path, "engine.probe", body.get("probe"),
                          "needs probe.url, or engine.health_url to derive /v1/completions from")
    grace = cfg.guard.grace
    for key, raw in _shutdown_values(e):
        try:
            secs = parse_duration(raw)
        except ValueError as err:
            raise ConfigError(path, key, raw, f"shutdown timeout: {err}") from None
        if secs >= grace:
            raise ConfigError(path, key, raw,
                              f"the engine's shutdown timeout ({secs:g} s) must be shorter than guard.grace "
                              f"({grace:g} s), or the guard SIGKILLs the workers before they tear CUDA down")


def load(path: str | None = None, *, mem_total: int | None = None, required: bool = False) -> Config:
    """Load the configuration file.

    Args:
        path: file to read; None means :data:`DEFAULT_PATH`.
        mem_total: MemTotal in bytes for validation (default: read /proc/meminfo).
        required: if True a missing file is an error; otherwise the embedded defaults apply.
    Returns:
        Config (``Config().path == "<defaults>"`` when the file is absent).
    Raises:
        ConfigError: unreadable file, not a regular file, over :data:`MAX_FILE_BYTES`, YAML syntax
        error, or an invalid value.
    """
    import yaml

    p = path or DEFAULT_PATH
    try:
        text = read_bounded(p)
    except FileNotFoundError:
        if required or path is not None and path != DEFAULT_PATH:
            raise ConfigError(p, "(file)", None, "file not found") from None
        return from_dict({}, "<defaults>", mem_total)
    p = os.path.abspath(p)
    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.MarkedYAMLError as e:
        where = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: " if e.problem_mark else ""
        raise ConfigError(p, "(syntax)", None, f"YAML error at {where}{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(p, "(syntax)", None, f"YAML error: {e}".replace("\n", " ")) from None
    except RecursionError:
        raise ConfigError(p, "(syntax)", None, "YAML nested too deeply") from None
    return from_dict(data, p, mem_total)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _regular(path: str, st: os.stat_result) -> None:
    """ConfigError naming the kind of file unless ``st`` is a regular file's."""
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a plain file")
        raise ConfigError(path, "(file)", None, f"is {kind}, not a regular file")


def read_bounded(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Opened with O_NONBLOCK, so a FIFO without a writer cannot hang the caller (open(2) returns at
    once for a reader), then refused by fstat(2) like any other non-regular file; at most
    ``limit + 1`` bytes are read, so /dev/zero or a file that grows cannot take memory.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: not a regular file, larger than ``limit`` bytes, or unreadable (the OS reason).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            _regular(path, os.stat(path))            # a socket: open(2) fails with ENXIO
        except OSError:
            pass
        raise ConfigError(path, "(file)", None, f"cannot read: {e.strerror}") from None
    try:
        _regular(path, os.fstat(fd))
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ConfigError(path, "(file)", None, f"larger than {limit // 1024} KiB: not a sparkguard config")
        return b"".join(chunks)
    except OSError as e:
        raise ConfigError(path, "(file)", None, f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)


_LOADER = None


#: Plain scalars read as numbers: decimal only (YAML 1.2 core schema without its 0o/0x forms).  An int
#: of more than 19 digits stays a string (and is refused by the key), so no int is too long for repr.
_INT = r"^[-+]?(?:0|[1-9][0-9]{0,18})$"
_FLOAT = (r"^[-+]?(?:(?:0|[1-9][0-9]*)\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"
          r"|^[-+]?(?:0|[1-9][0-9]*)[eE][-+]?[0-9]+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")
_RESOLVED_AGAIN = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")


class YamlFloat(float):
    """A float read from the file; ``text`` is the scalar as written, for keys that take strings."""

    text = ""


def _loader():
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)
    and reads numbers as the decimal written.

    YAML 1.1 (PyYAML) reads ``010`` as 8, ``0x10`` as 16, ``1_000`` as 1000, ``1:30`` as 90 and
    ``2026-01-01`` as a date.  Here those plain scalars stay strings, which every numeric key
    refuses with its reason (sparkguard.units); ``1e400`` and ``.inf`` are floats (inf), refused as
    not finite.  Booleans (``yes``/``no``/``on``/``off``/``true``/``false``) resolve as before.
    """
    global _LOADER
    if _LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            yaml_implicit_resolvers = {
                first: [(tag, rx) for tag, rx in rules if tag not in _RESOLVED_AGAIN]
                for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}

        Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(_INT), list("-+0123456789"))
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))

        def real(loader, node):
            f = YamlFloat(loader.construct_yaml_float(node))
            f.text = node.value
            return f

        Loader.add_constructor("tag:yaml.org,2002:float", real)

        def mapping(loader, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = loader.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a key that is a {type(key).__name__}", key_node.start_mark) from None
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
            return loader.construct_mapping(node, deep)

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        _LOADER = Loader
    return _LOADER


def replace(cfg: Config, **sections: Any) -> Config:
    """Return a copy of ``cfg`` with whole sections replaced (``replace(cfg, guard=g)``)."""
    return dataclasses.replace(cfg, **sections)

"""The configuration schema: one frozen dataclass per section and the SCHEMA table of key parsers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from sparkguard import meminfo
from sparkguard.config.engine import EngineConfig, parse_lane_name, parse_lanes, parse_load_phase, parse_probe
from sparkguard.config.startgate import parse_start_gate
from sparkguard.config.parsers import (
    DAY, HOUR, MIN_TICK, abs_path, argv_list, boolean, choice, duration, env_map, fall_rate, ifname_list, int_range,
    line_size, listen_address, optional_line_size, optional_str, optional_url, regex_list, size, url_list,
    user_name,
)


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
    # the rate trigger (sparkguard.rate, docs/rate.md): SIGTERM when the signal would reach
    # term_below within rate_lead seconds at its fall rate over the last rate_window seconds.
    # Off by default: bench/results/rate.txt (docs/rate.md says why).  rate_lead 1 s covers the
    # 0.5-0.9 s from the signal until a CUDA process's memory was back (FIELD-NOTES, H200).
    rate_trigger: str = "off"          # "off" | "on"
    rate_lead: float = 1.0
    rate_window: float = 1.0
    rate_min_fall: int = 256 * 1024**2      # bytes per second
    # the black box (sparkguard.blackbox, docs/blackbox.md): a ring of the last minute of samples
    blackbox: bool = True
    blackbox_file: str | None = None    # None: <incidents.dir>/blackbox.ring
    blackbox_sync: float = 1.0          # seconds between writeback starts while near the line (0: never)
    # the soft line (sparkguard.softline, docs/soft-line.md): off unless pause_below is set
    pause_below: int | None = None
    # assumption: 512 MiB and 10 s keep a fill that hovers at the line from pausing and resuming
    # several times a minute; nothing public measures it (docs/soft-line.md)
    pause_hysteresis: int = 512 * 1024**2
    resume_after: float = 10.0
    pause_url: str | None = None       # base URL of the engine's API server when no engine is supervised
    pause_mode: str = "keep"           # vLLM's /pause mode: "keep" | "abort"
    pause_timeout: float = 2.0


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
class ClusterConfig:
    """``cluster:``: this node's place in a cluster file (sparkguard.config.cluster, docs/cluster.md).

    Without a ``cluster:`` section every field is None.  ``file``: str, the cluster file's absolute
    path; ``node``: str, this node's name in it; ``name``: str, the cluster's name; ``nnodes``:
    int, its number of nodes; ``rank``: int, this node's ``--node-rank``; ``role``: ``"head"`` or
    ``"headless"``; ``digest``: str, the cluster file's digest (first 12 hex digits of the SHA-256
    of its bytes).
    """

    file: str | None = None
    node: str | None = None
    name: str | None = None
    nnodes: int | None = None
    rank: int | None = None
    role: str | None = None
    digest: str | None = None


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``path`` is where it came from (``"<defaults>"`` if embedded).
    ``cluster`` is not in :data:`SCHEMA`: the ``cluster:`` section is resolved into ``engine`` and
    ``metrics`` before the sections are built (sparkguard.config.cluster)."""

    guard: GuardConfig = field(default_factory=GuardConfig)
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    incidents: IncidentsConfig = field(default_factory=IncidentsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    path: str = "<defaults>"


#: section -> (dataclass, {key: parser}).  Bounds (README "Configuration"): anything that repeats
#: (poll_interval, health_interval, probe.interval) at least MIN_TICK, so no loop spins; every duration
#: below a day (an hour for the guard's own timers), sizes at most 1 PiB, so no timeout overflows
#: poll(2)'s int milliseconds or threading.TIMEOUT_MAX and SIGKILL always comes.
SCHEMA: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
    "guard": (GuardConfig, {
        "poll_interval": duration(MIN_TICK, 10.0),      # 10 s: memory can fall several GiB/s
        "term_below": line_size,
        "kill_below": optional_line_size,
        "grace": duration(0.0, HOUR),
        "signal": choice(*meminfo.SIGNALS),
        "dry_run": boolean,
        "recovery_wait": duration(0.0, HOUR),
        "rate_trigger": choice("off", "on"),
        "rate_lead": duration(0.0, 60.0),               # a minute: beyond it a forecast is a guess
        "rate_window": duration(0.05, 10.0),            # at least ~3 samples at the fastest cadence
        "rate_min_fall": fall_rate,
        "blackbox": boolean,
        "blackbox_file": lambda v: None if v is None else abs_path(v),
        "blackbox_sync": duration(0.0, 60.0),
        "pause_below": optional_line_size,
        "pause_hysteresis": size,
        "resume_after": duration(0.0, HOUR),
        "pause_url": optional_url,
        "pause_mode": choice("keep", "abort"),
        "pause_timeout": duration(MIN_TICK, 10.0),     # bounds the shutdown's last resume too
    }),
    "targets": (TargetsConfig, {
        "match": regex_list,
        "protect": regex_list,
        "fallback": choice("off", "oom_score"),
    }),
    "metrics": (MetricsConfig, {"listen": listen_address}),
    "incidents": (IncidentsConfig, {"dir": abs_path, "journal": choice("auto", "on", "off")}),
    "engine": (EngineConfig, {
        "command": argv_list,
        "env": env_map,
        "cwd": optional_str,
        "user": user_name,
        "identifier": optional_str,
        "log": choice("auto", "journal", "stderr"),
        "journal_socket": abs_path,
        "log_lines": int_range(1, 100000),
        "drop_caches": boolean,
        "start_above": size,
        "stable_for": duration(0.0, HOUR),
        "stable_band": size,
        "quiesce_timeout": duration(0.0, DAY),
        "health_url": optional_url,
        "health_interval": duration(MIN_TICK, HOUR),
        "ready_timeout": duration(MIN_TICK, DAY),
        "probe": parse_probe,
        "restart": choice("always", "on-failure", "never"),
        "backoff_initial": duration(0.0, DAY),
        "backoff_max": duration(0.0, DAY),
        "stable_after": duration(MIN_TICK, 7 * DAY),
        "shutdown_timeout": lambda v: None if v is None else duration(0.0, HOUR)(v),
        "lanes": parse_lanes,
        "lane": parse_lane_name,
        "state_file": abs_path,
        "control_socket": abs_path,
        "peers": url_list,
        "head_url": optional_url,
        "head_lost_after": duration(MIN_TICK, DAY),
        "give_up_after": int_range(0, 1000),
        "give_up_window": duration(MIN_TICK, 7 * DAY),
        "on_daemon_restart": choice("keep", "stop"),
        "on_daemon_stop": choice("stop", "keep"),
        "start_gate": parse_start_gate,
        "load_phase": parse_load_phase,
        "pause": choice("auto", "off"),
    }),
    "link": (LinkConfig, {
        "interfaces": ifname_list,
        "down_after": duration(0.0, DAY),
        "mark_unhealthy": boolean,
    }),
}

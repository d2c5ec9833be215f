"""The ``engine:`` section: its dataclasses, its nested parsers (probe, lanes) and the vLLM facts
its cross-checks need (the shutdown timeout that must end before the guard's SIGKILL)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from sparkguard.config.errors import NestedValueError
from sparkguard.config.parsers import (
    DAY, HOUR, MIN_TICK, duration, env_map, extra_args, fall_rate, int_range, line_size, optional_str, optional_url,
)
from sparkguard.config.startgate import StartGateConfig


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
class LoadPhaseConfig:
    """``engine.load_phase``: the guard's lines while the supervised engine loads (started, not yet
    ready: its port does not listen yet, FIELD-NOTES "vLLM").

    ``term_below`` None means ``guard.term_below``; ``rate_min_fall`` None means
    ``guard.rate_min_fall``.  ``rate_lead`` (seconds) 0, the default, means the load line alone:
    a load falls steeply by design (17-19 GiB in 10 s right after weights load, FIELD-NOTES "How GB10
    reports memory"), and the guard's rate trigger would stop loads that end above the line
    (bench/results/rate.txt, ``loadserve``).  Sizes in bytes, rates in bytes/s.
    """

    term_below: int | None = None
    rate_lead: float = 0.0
    rate_min_fall: int | None = None


@dataclass(frozen=True)
class LaneConfig:
    """One entry of ``engine.lanes``: extra ``args`` appended to ``engine.command`` and extra ``env``."""

    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineConfig:
    """``engine:``, the engine sparkguard starts and supervises.

    ``command`` None means no engine: sparkguard only guards.  Sizes in bytes, durations in
    seconds.  ``give_up_after`` failed starts (runs that end in failure before they are ever
    ready) within ``give_up_window`` stop the supervisor until ``sparkguard engine start`` (0:
    never give up).  ``shutdown_timeout`` None means: for a vLLM command, derived from ``guard.grace``
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
    give_up_after: int = 3
    give_up_window: float = 7200.0
    # when the daemon exits: keep the engine running for the next daemon to adopt, or stop it
    # (sparkguard.supervisor.handover, docs/adoption.md)
    on_daemon_restart: str = "keep"    # "keep" | "stop": systemd restarts the unit
    on_daemon_stop: str = "stop"       # "stop" | "keep": systemd stops the unit
    start_gate: StartGateConfig = field(default_factory=StartGateConfig)
    load_phase: LoadPhaseConfig | None = None       # None: LoadPhaseConfig()'s defaults
    pause: str = "auto"                # "auto": the soft line pauses this engine when it offers /pause; "off"

    @property
    def enabled(self) -> bool:
        """True when an engine command is configured."""
        return self.command is not None


_PROBE_KEYS: dict[str, Callable[[Any], Any]] = {
    "url": optional_url, "model": optional_str, "interval": duration(MIN_TICK, DAY),
    "timeout": duration(MIN_TICK, HOUR), "failures": int_range(1, 1000),
}


def parse_probe(v: Any) -> ProbeConfig | None:
    """``engine.probe``: ``off`` (None), ``on`` (the defaults) or a mapping of :data:`_PROBE_KEYS`.

    Raises ValueError, or NestedValueError naming the key below ``probe``.
    """
    if v is None or v is False or (isinstance(v, str) and v.lower() == "off"):
        return None
    if v is True or (isinstance(v, str) and v.lower() == "on"):
        return ProbeConfig()
    if not isinstance(v, dict):
        raise ValueError("expected off, on, or a mapping with " + ", ".join(_PROBE_KEYS))
    return ProbeConfig(**_nested(v, _PROBE_KEYS))


def _nested(v: dict, keys: dict[str, Callable[[Any], Any]]) -> dict:
    """Each key of the mapping ``v`` parsed by its parser in ``keys``.  Raises NestedValueError
    naming the key below the section's (an unknown one, or the parser's ValueError)."""
    vals = {}
    for k, x in v.items():
        if k not in keys:
            raise NestedValueError(f".{k}", x, "unknown key; expected one of " + ", ".join(keys))
        try:
            vals[k] = keys[k](x)
        except NestedValueError:
            raise
        except ValueError as e:
            raise NestedValueError(f".{k}", x, str(e)) from None
    return vals


_LOAD_KEYS: dict[str, Callable[[Any], Any]] = {
    "term_below": line_size, "rate_lead": duration(0.0, 60.0), "rate_min_fall": fall_rate,
}


def parse_load_phase(v: Any) -> LoadPhaseConfig | None:
    """``engine.load_phase``: a mapping of ``term_below``, ``rate_lead``, ``rate_min_fall`` (each
    optional), or null for the defaults (None).  Raises ValueError, or NestedValueError naming the key."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError("expected a mapping with " + ", ".join(_LOAD_KEYS))
    return LoadPhaseConfig(**_nested(v, _LOAD_KEYS))


_LANE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def parse_lanes(v: Any) -> dict:
    """``engine.lanes``: ``{name: LaneConfig}``, each lane a mapping of ``args`` and/or ``env``.

    Raises ValueError, or NestedValueError naming the lane and key (``.big.args``).
    """
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
            parser = {"args": extra_args, "env": env_map}.get(k)
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


def parse_lane_name(v: Any) -> str | None:
    """``engine.lane``: a lane name (checked against ``engine.lanes`` by the load), or None."""
    if v is None:
        return None
    if not isinstance(v, str) or not _LANE_NAME.match(v):
        raise ValueError("expected the name of one of engine.lanes")
    return v


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


def shutdown_values(e: EngineConfig) -> list[tuple[str, Any]]:
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

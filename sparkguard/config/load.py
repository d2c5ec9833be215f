"""Loading the configuration: the file or the embedded defaults, built through SCHEMA, then the
checks across keys (lines against MemTotal, the engine's timeouts against the guard's grace)."""

from __future__ import annotations

import os
from typing import Any

from sparkguard.config import cluster as cluster_section
from sparkguard.config.engine import EngineConfig, shutdown_values
from sparkguard.config.errors import ConfigError, NestedValueError
from sparkguard.config.schema import SCHEMA, Config
from sparkguard.config.yamlload import parse, read_bounded
from sparkguard import meminfo
from sparkguard.supervisor import container_argv
from sparkguard.units import parse_duration


DEFAULT_PATH = "/etc/sparkguard/sparkguard.yaml"


def _mem_total() -> int | None:
    try:
        return meminfo.read().get("MemTotal")
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
    A ``cluster:`` section is resolved first (:func:`sparkguard.config.cluster.resolve`): the
    cluster file is read again on every call, so a reload sees its changes.
    Raises:
        ConfigError: unknown section or key, wrong type, or impossible value; an error of the
        cluster file names that file.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, "(top level)", data, "expected a mapping of sections: "
                          + ", ".join([*SCHEMA, "cluster"]))
    data, cluster = cluster_section.resolve(data, path)
    sections: dict[str, Any] = {}
    for name, body in data.items():
        if name not in SCHEMA:
            raise ConfigError(path, str(name), body, "unknown section; expected one of "
                              + ", ".join([*SCHEMA, "cluster"]))
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
    cfg = Config(path=path, cluster=cluster, **sections)
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
    if g.pause_below is not None and g.pause_below <= g.term_below:
        raise ConfigError(path, "guard.pause_below", _raw(data, "guard.pause_below"),
                          f"is not above guard.term_below ({g.term_below} bytes); the soft line must come first")
    if total is not None and g.pause_below is not None and g.pause_below >= total:
        raise ConfigError(path, "guard.pause_below", _raw(data, "guard.pause_below"),
                          f"is not below MemTotal ({total} bytes)")
    if not cfg.targets.match and cfg.targets.fallback == "off":
        raise ConfigError(path, "targets.match", [], "empty with targets.fallback off: nothing could ever be signalled")
    _check_engine(cfg, data, path, total)


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
    lp = e.load_phase.term_below if e.load_phase is not None else None
    if lp is not None and total is not None and lp >= total:
        raise ConfigError(path, "engine.load_phase.term_below", (body.get("load_phase") or {}).get("term_below"),
                          f"is not below MemTotal ({total} bytes)")
    if e.backoff_max < e.backoff_initial:
        raise ConfigError(path, "engine.backoff_max", body.get("backoff_max"),
                          f"is below engine.backoff_initial ({e.backoff_initial:g} s)")
    if e.probe is not None and e.probe.url is None and e.health_url is None:
        raise ConfigError(path, "engine.probe", body.get("probe"),
                          "needs probe.url, or engine.health_url to derive /v1/completions from")
    try:        # a docker|podman run command line: refused options now, not at the first start
        ctr = container_argv.parse(list(e.command))
        why = container_argv.refusal(ctr) if ctr is not None else None
    except ValueError as err:
        why = str(err)
    if why is not None:
        raise ConfigError(path, "engine.command", body.get("command"), why)
    grace = cfg.guard.grace
    for key, raw in shutdown_values(e):
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
    p = path or DEFAULT_PATH
    try:
        text = read_bounded(p)
    except FileNotFoundError:
        if required or path is not None and path != DEFAULT_PATH:
            raise ConfigError(p, "(file)", None, "file not found") from None
        return from_dict({}, "<defaults>", mem_total)
    p = os.path.abspath(p)
    return from_dict(parse(text, p), p, mem_total)

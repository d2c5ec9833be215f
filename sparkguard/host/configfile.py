"""The commented default ``/etc/sparkguard/sparkguard.yaml`` that ``install`` writes.

It is generated from :data:`sparkguard.config.SCHEMA` and the dataclass defaults, so it
is exactly the embedded defaults for every section, including sections added later: each
value is rendered in the most readable form (``0.75GiB``, ``200ms``, ``127.0.0.1:8799``)
that the key's own parser turns back into the default, and :func:`render` checks the
whole text with :func:`sparkguard.config.from_dict` before returning it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable

import yaml

from sparkguard import __version__, config

#: first line of the file we write; the rest says how to change it
HEADER = """\
# sparkguard configuration: written by `sparkguard install` ({version}).
# Every value below is the built-in default; change what you need and run
# `systemctl reload sparkguard` (a bad value is refused and the running configuration kept).
# `sparkguard check-config` validates this file.  Sizes: 0.75GiB, 768MiB or bytes;
# durations: 200ms, 10s, 5m.  `sparkguard install` never overwrites this file once edited.
"""

#: comments per dotted key (facts from sparkguard/config/ and FIELD-NOTES)
HELP: dict[str, str] = {
    "guard": "When to act.",
    "guard.poll_interval": "How often MemAvailable is read. Free memory has been seen to fall ~3 GiB/s during prefill.",
    "guard.term_below": "SIGTERM the engine when the watched value (see signal) falls below this.",
    "guard.kill_below": "SIGKILL the whole engine tree at once below this (null: only after the grace period).",
    "guard.grace": "Time from SIGTERM to SIGKILL of the whole tree; keep it longer than the engine's own "
                   "shutdown timeout (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS).",
    "guard.signal": "available: MemAvailable; available+swap: MemAvailable + SwapFree.",
    "guard.dry_run": "true: record incidents and log what would be signalled, signal nothing.",
    "guard.recovery_wait": "After a kill, how long to wait for the memory to come back before choosing another victim.",
    "guard.rate_trigger": "on: also SIGTERM when the value, falling at its estimated rate, would reach term_below "
                          "within rate_lead (docs/rate.md; off by default, from the benchmark there).",
    "guard.rate_lead": "How far ahead the rate trigger looks: at least the engine's time from SIGTERM to its memory back.",
    "guard.rate_window": "Seconds of samples the fall rate is estimated over (a robust median of slopes).",
    "guard.rate_min_fall": "Bytes per second (e.g. 256MiB/s): a slower fall never triggers.",
    "guard.blackbox": "true: keep the last minute of samples in a file, so that the next start after a reset "
                      "records an unclean-shutdown incident with them (docs/blackbox.md).",
    "guard.blackbox_file": "The black box's file (null: blackbox.ring in incidents.dir).",
    "guard.blackbox_sync": "While memory is near the line, start writeback of the black box this often "
                           "(0: leave it to the kernel's, ~30 s).",
    "guard.pause_below": "The soft line (null: off): below it the engine is paused (vLLM POST /pause, needs "
                         "VLLM_SERVER_DEV_MODE=1) before any kill; must be above term_below (docs/soft-line.md).",
    "guard.pause_hysteresis": "Resume only once the watched value is this far above pause_below ...",
    "guard.resume_after": "... for this long.",
    "guard.pause_url": "The engine's base URL (http://127.0.0.1:8000) when no engine is supervised; "
                       "null: engine.health_url's.",
    "guard.pause_mode": "vLLM's pause mode: keep (requests held, resumed as they were) or abort (in-flight ones "
                        "end with finish_reason abort).",
    "guard.pause_timeout": "Deadline of one pause or resume request.",
    "engine.pause": "auto: the soft line pauses this engine if it offers /pause; off: never.",
    "targets": "Whom to signal.",
    "targets.match": "Regular expressions searched in /proc/PID/cmdline (for setproctitle'd processes the title, "
                     "e.g. VLLM::EngineCore); earlier ones are preferred.",
    "targets.protect": "Never signalled: regular expressions matched in full against /proc/PID/comm and argv[0]'s basename.",
    "targets.fallback": "off: only matched processes; oom_score: otherwise the process with the highest oom_score.",
    "metrics": "Prometheus endpoint.",
    "metrics.listen": "host:port to serve /metrics on, or off.",
    "incidents": "Incident records.",
    "incidents.dir": "One JSON file per incident.",
    "incidents.journal": "Write incidents to the systemd journal: auto (when it runs), on, off.",
    "engine": "The inference engine sparkguard starts and supervises (README \"Supervising the engine\"). "
              "command null: sparkguard only guards. With a command, `sparkguard install` adds the engine "
              "sandbox drop-in (sparkguard.service.d/engine.conf) so that the engine can write its caches.",
    "engine.command": "argv list, e.g. [/usr/local/bin/vllm, serve, /models/m, --port, \"8000\"]; null: no engine.",
    "engine.env": "Extra environment of the engine (over sparkguard's own), e.g. {HF_HUB_OFFLINE: \"1\"}.",
    "engine.cwd": "Working directory of the engine (null: sparkguard's).",
    "engine.user": "Run the engine as this user (name or uid, its groups, HOME); null: root, like the guard.",
    "engine.identifier": "Journal identifier of the engine's output (null: the program's name, e.g. vllm).",
    "engine.log": "Engine output goes to: auto (the journal when it runs, else stderr), journal, stderr.",
    "engine.journal_socket": "journald's native socket.",
    "engine.log_lines": "How many of the engine's last output lines incident reports keep.",
    "engine.drop_caches": "sync and drop the page cache before every start (vLLM counts page cache as used).",
    "engine.start_above": "MemAvailable needed before a (re)start.",
    "engine.stable_for": "... and steady for this long (memory stranded by a kill comes back slowly).",
    "engine.stable_band": "Steady means: MemAvailable moves less than this during stable_for.",
    "engine.quiesce_timeout": "Start anyway (and record it) when the memory and peers gates are not met after this.",
    "engine.health_url": "Ready when this answers 200, e.g. http://127.0.0.1:8000/health (null: once started).",
    "engine.health_interval": "How often health_url (and head_url) is polled.",
    "engine.ready_timeout": "Restart when health_url is not 200 this long after a start (loading takes minutes).",
    "engine.probe": "Liveness: a one-token completion {interval, timeout, failures, url, model}; null: off.",
    "engine.restart": "always, on-failure (not after a clean exit 0), never.",
    "engine.backoff_initial": "First delay of an automatic restart; doubles per restart in a row.",
    "engine.backoff_max": "Longest delay between automatic restarts.",
    "engine.stable_after": "A run this long resets the backoff.",
    "engine.shutdown_timeout": "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (null: grace - max(2 s, grace/5)); below grace.",
    "engine.lanes": "Named variants: {name: {args: [...], env: {...}}}, args appended to command, env merged.",
    "engine.lane": "Lane to start in (null: the first); `sparkguard engine lane NAME` switches.",
    "engine.state_file": "Where the current lane and the engine's pids survive a daemon restart.",
    "engine.control_socket": "Root-only unix socket of `sparkguard engine` (no network control surface).",
    "engine.peers": "Other nodes' sparkguard metrics URLs (a TP cluster: all others; README \"TP cluster\").",
    "engine.head_url": "Headless rank: the head's health URL; restart this rank when it fails for head_lost_after.",
    "engine.head_lost_after": "How long the head may fail (after it had answered) before this rank restarts.",
    "engine.give_up_after": "Failed starts (runs that fail before they are ready) that stop the supervisor; 0: never.",
    "engine.give_up_window": "... counted within this window; `sparkguard engine start` tries again.",
    "engine.on_daemon_restart": "systemctl restart sparkguard: keep the engine for the next daemon to adopt, or stop.",
    "engine.on_daemon_stop": "systemctl stop sparkguard: stop the engine, or keep it running unguarded.",
    "engine.start_gate": "Compaction and the MemFree gate before a start (docs/start-gate.md); null: auto.",
    "engine.load_phase": "Lines while loading (not ready): {term_below, rate_lead, rate_min_fall}; null: defaults.",
    "link": "TP fabric links watched through netlink.",
    "link.interfaces": "Interface names (the ConnectX-7 ports); empty: no link watch.",
    "link.down_after": "How long a link must stay down before it is an incident.",
    "link.mark_unhealthy": "A link incident also marks the supervised engine unhealthy: restarted once the link is back.",
}

#: the commented cluster: section at the end of the file (it has no default: the file is the node's own)
CLUSTER_EXAMPLE = """\
# One node of a TP cluster (docs/cluster.md): the same cluster file on every node names the nodes
# and the engine command and lanes they share; this node's engine command (--nnodes, --node-rank,
# --master-addr, --master-port, --headless), peers, head URL and metrics.listen are derived from it,
# so engine.command, lanes, lane, peers, head_url and health_url are not set here.  node: this
# node's name in the file (default: the hostname).
#cluster:
#  file: /etc/sparkguard/cluster.yaml
#  node: spark-1
"""

_GIB, _MIB, _KIB = 1024**3, 1024**2, 1024


def _candidates(value: Any) -> list[Any]:
    """Renderings of a default, most readable first."""
    out: list[Any] = []
    if value is None:
        return [None, "off"]
    if isinstance(value, bool):
        return [value]
    if dataclasses.is_dataclass(value):         # a nested section (engine.start_gate): its keys, each at its best
        return [{f.name: _candidates(getattr(value, f.name))[0] for f in dataclasses.fields(value)}]
    if isinstance(value, int):
        for unit, mult in (("GiB", _GIB), ("MiB", _MIB), ("KiB", _KIB)):
            q = value / mult
            if q >= 0.25 and abs(q * mult - value) < 1 and float(f"{q:g}") * mult == value:
                out.append(f"{q:g}{unit}")
        return out + [value]
    if isinstance(value, float):
        if value and value < 1:
            out.append(f"{value * 1000:g}ms")
        if value >= 60 and value % 60 == 0:
            out.append(f"{value / 60:g}m")
        out.append(f"{value:g}s")
        return out + [value]
    if isinstance(value, tuple):
        if len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
            out.append(f"{value[0]}:{value[1]}")
        return out + [list(value)]
    return [value]


def _render_value(dotted: str, default: Any, parser: Callable[[Any], Any]) -> Any:
    for cand in _candidates(default):
        try:
            if parser(yaml.safe_load(yaml.safe_dump(cand))) == default:
                return cand
        except (ValueError, TypeError):
            continue
    raise RuntimeError(f"no YAML rendering of {dotted} = {default!r} parses back to the default")


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {ln}" for ln in textwrap.wrap(text, 92 - len(indent))]


def render() -> str:
    """The default configuration file text.

    Returns:
        str, YAML with comments; ``sparkguard.config.load`` of it gives ``Config()``.
    Raises:
        RuntimeError: a default cannot be rendered so that it parses back to itself
            (a schema change this module does not understand).
    """
    lines = [HEADER.format(version=__version__).rstrip("\n")]
    defaults = config.Config()
    for section, (cls, parsers) in config.SCHEMA.items():
        lines.append("")
        lines += _comment(HELP.get(section, f"Section {section} (see README)."), "")
        lines.append(f"{section}:")
        sec_default = getattr(defaults, section, None) or cls()
        for key, parser in parsers.items():
            default = getattr(sec_default, key)
            value = _render_value(f"{section}.{key}", default, parser)
            if f"{section}.{key}" in HELP:
                lines += _comment(HELP[f"{section}.{key}"], "  ")
            dumped = yaml.safe_dump({key: value}, default_flow_style=False, sort_keys=False,
                                    allow_unicode=True, width=1000).rstrip("\n").splitlines()
            lines += ["  " + ln for ln in dumped]
    lines += ["", CLUSTER_EXAMPLE.rstrip("\n")]
    text = "\n".join(lines) + "\n"
    check = config.from_dict(yaml.safe_load(text), "<rendered defaults>")
    if dataclasses.replace(check, path=defaults.path) != defaults:
        raise RuntimeError("rendered default configuration does not load back to the built-in defaults")
    return text

"""Configuration: embedded defaults, sizes/durations, and errors that name file, key and value."""

import os

import pytest

from conftest import run_sparkguard
from unprivileged import nobody  # noqa: F401 - fixture
from sparkguard import config
from sparkguard.units import parse_duration, parse_size

GiB = 1024**3


def test_units():
    assert parse_size("0.75GiB") == int(0.75 * GiB)
    assert parse_size("768MiB") == 768 * 1024**2
    assert parse_size(805306368) == 805306368
    assert parse_size("805306368") == 805306368
    assert parse_size("1GB") == 10**9
    assert parse_duration("200ms") == pytest.approx(0.2)
    assert parse_duration("20s") == 20.0
    assert parse_duration(3) == 3.0
    assert parse_duration("5m") == 300.0
    for bad in ("-1", "lots", "1XB", True, [1]):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("-2s", "soon", "1y", None):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_defaults_when_file_absent(tmp_path):
    cfg = config.load(None) if not os.path.exists(config.DEFAULT_PATH) else config.from_dict({})
    assert cfg.guard.poll_interval == 0.2
    assert cfg.guard.term_below == int(0.75 * GiB)
    assert cfg.guard.kill_below is None
    assert cfg.metrics.listen == ("127.0.0.1", 8799)
    assert cfg.incidents.dir == "/var/lib/sparkguard/incidents"
    assert any("vllm" in p for p in cfg.targets.match)


@pytest.mark.parametrize("text,key,value,why", [
    ("guard:\n  grace: -5s\n", "guard.grace", "-5s", "duration"),
    ("guard:\n  term_below: 10TiB\n", "guard.term_below", "10TiB", "MemTotal"),
    ("guard:\n  term_below: 1GiB\n  kill_below: 2GiB\n", "guard.kill_below", "2GiB", "above guard.term_below"),
    ("guard:\n  colour: red\n", "guard.colour", "red", "unknown key"),
    ("gaurd:\n  grace: 5s\n", "gaurd", "", "unknown section"),
    ("guard:\n  dry_run: maybe\n", "guard.dry_run", "maybe", "true or false"),
    ("guard:\n  signal: vibes\n", "guard.signal", "vibes", "available"),
    ("targets:\n  match: ['(unclosed']\n", "targets.match", "(unclosed", "bad regular expression"),
    ("targets:\n  fallback: biggest\n", "targets.fallback", "biggest", "oom_score"),
    ("metrics:\n  listen: 99999\n", "metrics.listen", "99999", "host:port"),
    ("incidents:\n  journal: sometimes\n", "incidents.journal", "sometimes", "auto"),
    ("guard: [1, 2]\n", "guard", "", "mapping"),
    ("guard:\n  grace: [\n", "", "", "YAML error at line"),
    ("guard:\n  grace: 5s\n  grace: 9s\n", "", "", "key 'grace' is given twice"),
    ("guard:\n  term_below: 0.75\n", "guard.term_below", "0.75", "did you mean 0.75GiB"),
    ("guard:\n  term_below: 1KiB\n", "guard.term_below", "1KiB", "at least 16MiB"),
    ("incidents:\n  dir: var/incidents\n", "incidents.dir", "var/incidents", "absolute path"),
    ("guard:\n  poll_interval: .nan\n", "guard.poll_interval", "nan", "not a number (NaN)"),
    ("guard:\n  grace: .inf\n", "guard.grace", "inf", "infinite"),
    ("guard:\n  grace: 1e400\n", "guard.grace", "inf", "infinite"),
    ("guard:\n  term_below: .inf\n", "guard.term_below", "inf", "infinite"),
    ("guard:\n  grace: 010\n", "guard.grace", "'010'", "leading zero"),
    ("guard:\n  grace: 1:30\n", "guard.grace", "'1:30'", "sexagesimal"),
])
def test_bad_config_names_file_key_value(tmp_path, text, key, value, why):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(path))
    msg = str(e.value)
    assert str(path) in msg and key in msg and value in msg and why in msg, msg

    # sparkguard run refuses to start, check-config reports the same error
    r = run_sparkguard("run", "--config", str(path), timeout=30)
    assert r.returncode == 2
    assert str(path) in r.stderr and key in r.stderr and why in r.stderr
    c = run_sparkguard("check-config", str(path), timeout=30)
    assert c.returncode == 1 and key in c.stderr and why in c.stderr
    assert "Traceback" not in r.stderr + c.stderr


def test_bare_off_is_off_not_a_bool(tmp_path):
    path = tmp_path / "off.yaml"
    path.write_text("targets:\n  fallback: off\nincidents:\n  journal: off\nmetrics:\n  listen: off\n")
    cfg = config.load(str(path))
    assert (cfg.targets.fallback, cfg.incidents.journal, cfg.metrics.listen) == ("off", "off", None)


def test_check_config_ok(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("guard:\n  term_below: 1GiB\n  grace: 20s\n  kill_below: 512MiB\nmetrics:\n  listen: off\n")
    r = run_sparkguard("check-config", str(path))
    assert r.returncode == 0, r.stderr
    assert run_sparkguard("check-config", "--config", str(path)).stdout == r.stdout
    assert "OK" in r.stdout and "1.00 GiB" in r.stdout and "20.0 s" in r.stdout and "metrics: off" in r.stdout


def test_missing_explicit_config_is_an_error(tmp_path):
    r = run_sparkguard("run", "--config", str(tmp_path / "nope.yaml"), timeout=30)
    assert r.returncode != 0 and "file not found" in r.stderr


def test_a_misspelled_option_gets_the_sub_commands_usage_and_a_hint():
    r = run_sparkguard("run", "--dry-rnu", timeout=30)
    assert r.returncode == 2
    assert "usage: sparkguard run" in r.stderr
    assert "--dry-rnu: did you mean --dry-run?" in r.stderr


# --- numbers: NaN, infinities, overflow and YAML 1.1 forms never become another value

DURATIONS = ["guard.poll_interval", "guard.grace", "guard.recovery_wait", "engine.stable_for",
             "engine.quiesce_timeout", "engine.health_interval", "engine.ready_timeout", "engine.backoff_initial",
             "engine.backoff_max", "engine.stable_after", "engine.shutdown_timeout", "engine.head_lost_after",
             "engine.probe.interval", "engine.probe.timeout", "link.down_after"]
SIZES = ["guard.term_below", "guard.kill_below", "engine.start_above", "engine.stable_band"]
WHOLE = ["engine.log_lines", "engine.probe.failures"]


def _doc(dotted: str, raw: str) -> str:
    """A config text with ``raw`` written verbatim as the value of ``dotted``."""
    parts = dotted.split(".")
    if parts[0] == "engine":
        head = "engine:\n  command: [sleep, '60']\n  health_url: http://127.0.0.1:1/health\n"
        if parts[1] == "probe":
            return head + f"  probe:\n    {parts[2]}: {raw}\n"
        return head + f"  {parts[1]}: {raw}\n"
    return f"{parts[0]}:\n  {parts[1]}: {raw}\n"


YAML11 = [("010", "leading zero"), ("0o10", "another base"), ("0x10", "another base"),
          ("1:30", "sexagesimal"), ("1_000", "'_'"), ("-010", "leading zero")]
NONFINITE = [(".nan", "NaN"), (".inf", "infinite"), ("-.inf", "infinite"), ("1e400", "infinite"),
             ("1.0e+400", "infinite")]


@pytest.mark.parametrize("dotted", DURATIONS + SIZES + WHOLE)
@pytest.mark.parametrize("raw,why", YAML11 + NONFINITE + [
    ("123456789012345678901234567890", ""), ("9999999999999999999", ""), ("true", ""), ("yes", ""),
    ("2026-01-01", ""), ("'1e400GiB'", "")])
def test_every_numeric_key_refuses_nonfinite_overflow_and_yaml11_numbers(tmp_path, dotted, raw, why):
    path = tmp_path / "n.yaml"
    path.write_text(_doc(dotted, raw))
    with pytest.raises(config.ConfigError) as e:
        config.load(str(path), mem_total=128 * GiB)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {dotted}: "), msg
    if dotted in WHOLE and (raw, why) in NONFINITE:
        why = "whole number"
    elif raw == "'1e400GiB'":
        why = "infinite" if dotted in SIZES else "whole number" if dotted in WHOLE else "expected a duration"
    assert why in msg, msg


@pytest.mark.parametrize("text,key,why", [
    ("guard:\n  poll_interval: 0\n", "guard.poll_interval", "must be from 10ms to 10s"),
    ("guard:\n  poll_interval: 1e-9\n", "guard.poll_interval", "must be from 10ms to 10s"),
    ("guard:\n  poll_interval: 11s\n", "guard.poll_interval", "must be from 10ms to 10s"),
    ("guard:\n  grace: 1e300\n", "guard.grace", "must be from 0 to 1h"),
    ("guard:\n  recovery_wait: 2h\n", "guard.recovery_wait", "must be from 0 to 1h"),
    ("guard:\n  term_below: 2000TiB\n", "guard.term_below", "at most 1024TiB"),
    ("link:\n  down_after: 25h\n", "link.down_after", "must be from 0 to 24h"),
    ("engine:\n  command: [x]\n  health_interval: 1ms\n", "engine.health_interval", "must be from 10ms to 1h"),
    ("engine:\n  command: [x]\n  user: 99999999999999999999\n", "engine.user", "no such user"),
    ("engine:\n  command: [x]\n  env: {VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS: .nan}\n",
     "engine.env.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "shutdown timeout"),
    ("engine:\n  command: [vllm, serve, m, --shutdown-timeout=1e400]\n", "engine.command", "infinite"),
])
def test_absurd_values_that_would_break_the_loop_are_refused(tmp_path, text, key, why):
    path = tmp_path / "b.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(path), mem_total=128 * GiB)
    assert f"{path}: {key}: " in str(e.value) and why in str(e.value), str(e.value)


def test_numbers_are_read_as_written_and_booleans_keep_working(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("guard:\n  poll_interval: .5\n  grace: 1e1\n  term_below: '1.5GiB'\n  kill_below: off\n"
                    "  dry_run: yes\n  recovery_wait: 0\n"
                    "targets:\n  fallback: no\nmetrics:\n  listen: off\nincidents:\n  journal: on\n"
                    "engine:\n  command: [sleep, '60']\n  drop_caches: no\n  log_lines: 10\n"
                    "  env: {A: 010, B: 0x10, C: 1:30, D: 2026-01-01, E: 1e3, F: 1.50}\n"
                    "  health_url: http://127.0.0.1:1/health\n  probe: on\n"
                    "  lanes: {big: {args: [--n, 010, 1_000, 2.50]}}\n"
                    "link:\n  mark_unhealthy: true\n  down_after: 1.5e0\n")
    cfg = config.load(str(path), mem_total=128 * GiB)
    g = cfg.guard
    assert (g.poll_interval, g.grace, g.term_below, g.kill_below, g.dry_run, g.recovery_wait) == \
        (0.5, 10.0, int(1.5 * GiB), None, True, 0.0)
    assert (cfg.targets.fallback, cfg.metrics.listen, cfg.incidents.journal) == ("off", None, "on")
    e = cfg.engine
    # YAML 1.1: 8, 16, 90, a date; str() of the floats: 1000.0, 1.5
    assert e.env == {"A": "010", "B": "0x10", "C": "1:30", "D": "2026-01-01", "E": "1e3", "F": "1.50"}
    assert e.lanes["big"].args == ("--n", "010", "1_000", "2.50")
    assert (e.drop_caches, e.log_lines, e.probe) == (False, 10, config.ProbeConfig())
    assert (cfg.link.mark_unhealthy, cfg.link.down_after) == (True, 1.5)
    for text, want in (("dry_run: no", False), ("dry_run: off", False), ("dry_run: true", True),
                       ("dry_run: on", True), ("dry_run: false", False), ("kill_below: no", None)):
        path.write_text(f"guard:\n  {text}\n")
        assert getattr(config.load(str(path), mem_total=128 * GiB).guard, text.split(":")[0]) is want, text


# --- the file itself: only a regular file of a sane size is read


def _limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 * GiB, 4 * GiB))   # an unbounded read fails, not the box


@pytest.mark.parametrize("kind", ["zero", "fifo", "directory", "big", "socket"])
def test_config_path_that_is_not_a_small_regular_file_is_refused(tmp_path, kind):
    import socket
    if kind == "zero":
        path, why = "/dev/zero", "is a character device, not a regular file"
    elif kind == "fifo":
        path, why = str(tmp_path / "fifo"), "is a FIFO, not a regular file"
        os.mkfifo(path)             # nobody ever opens it for writing: a blocking open would hang
    elif kind == "directory":
        path, why = str(tmp_path), "is a directory, not a regular file"
    elif kind == "socket":
        path, why = str(tmp_path / "s"), "is a socket, not a regular file"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
    else:
        path, why = str(tmp_path / "big.yaml"), "larger than 1024 KiB"
        with open(path, "w") as f:
            f.write("# " + "x" * (2 * 1024**2) + "\nguard:\n  grace: 5s\n")
    c = run_sparkguard("check-config", path, timeout=30, preexec_fn=_limit_memory)
    assert c.returncode == 1 and f"{path}: {why}" in c.stderr, c.stderr
    r = run_sparkguard("run", "--config", path, timeout=30, preexec_fn=_limit_memory)
    assert r.returncode == 2 and f"{path}: {why}" in r.stderr, r.stderr


def test_unreadable_config_is_refused_with_the_os_reason(nobody):
    path = nobody.dir / "secret.yaml"
    path.write_text("guard:\n  grace: 5s\n")
    os.chmod(path, 0o600)           # root's; nobody cannot read it
    import subprocess
    c = subprocess.run(nobody.sparkguard("check-config", str(path)), capture_output=True, text=True, timeout=60)
    assert c.returncode == 1 and f"{path}: cannot read: Permission denied" in c.stderr, c.stderr

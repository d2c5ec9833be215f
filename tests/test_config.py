"""Configuration: embedded defaults, sizes/durations, and errors that name file, key and value."""

import os

import pytest

from conftest import run_sparkguard
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
    assert r.returncode != 0
    assert str(path) in r.stderr and key in r.stderr and why in r.stderr
    c = run_sparkguard("check-config", str(path), timeout=30)
    assert c.returncode == 1 and key in c.stderr and why in c.stderr


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

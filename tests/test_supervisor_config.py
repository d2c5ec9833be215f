"""The supervisor's pure pieces (fake clock) and the ``engine:`` config section's errors."""

from __future__ import annotations

import pytest

from conftest import run_sparkguard
from sparkguard import config
from sparkguard.supervisor import gates, output, render, restart

GiB = 1024**3
MiB = 1024**2


# ---- quiesce gate and backoff, driven by a fake clock

def test_quiesce_gate_needs_the_floor_for_the_whole_stable_period():
    g = gates.QuiesceGate(start_above=10 * GiB, stable_for=3.0, band=256 * MiB)
    assert not g.feed(0.0, 9 * GiB)
    assert not g.feed(1.0, 11 * GiB)
    assert not g.feed(3.9, 11 * GiB)
    assert g.feed(4.0, 11 * GiB)          # 3 s at/above the floor, steady
    assert not g.feed(4.5, 9 * GiB)       # a dip restarts the wait
    assert not g.feed(5.0, 11 * GiB)
    assert g.feed(8.0, 11 * GiB)


def test_quiesce_gate_waits_while_memory_is_still_coming_back():
    g = gates.QuiesceGate(start_above=10 * GiB, stable_for=2.0, band=256 * MiB)
    t, v = 0.0, 10 * GiB
    opened = None
    # stranded memory comes back at 1 GiB/s for 5 s, then stays
    for i in range(100):
        t = i * 0.25
        v = 10 * GiB + int(min(t, 5.0) * GiB)
        if g.feed(t, v):
            opened = t
            break
    # the rise stops at t=5 s; the gate opens stable_for (2 s) after the rise flattened into the band
    assert opened is not None and 6.5 <= opened <= 7.25, opened


def test_quiesce_gate_zero_stable_for_opens_at_once():
    assert gates.QuiesceGate(1, 0.0, 0).feed(0.0, 2)


def test_backoff_doubles_caps_and_resets_after_a_stable_run():
    b = restart.Backoff(initial=1.0, maximum=10.0, stable_after=60.0)
    assert [b.next(uptime=2.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.next(uptime=61.0) == 1.0       # the last run was stable: start over
    assert b.next(uptime=1.0) == 2.0
    b.reset()
    assert b.next(uptime=1.0) == 1.0


def test_identifier_is_the_program_name():
    assert output.identifier_for(["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"]) == "vllm"
    assert output.identifier_for(["vllm", "serve", "m"]) == "vllm"
    assert output.identifier_for(["python3", "-m", "sglang.launch_server"]) == "sglang"
    assert output.identifier_for(["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"]) == "tritonserver"


def test_log_priority_from_the_level_prefix():
    assert output._level_priority("INFO 05-14 10:22:33 [api_server.py:1] up", 4) == 6
    assert output._level_priority("(EngineCore pid=7) ERROR 05-14 boom", 6) == 3
    assert output._level_priority("WARNING: something", 6) == 4
    assert output._level_priority("plain text", 4) == 4


def test_describe_reads_like_a_status_screen():
    detail = "restarting in 4.0 s (3 restarts in a row); last run: exit code 1 after 100 ms"
    lines = render.describe({"state": "backoff", "detail": detail, "pid": None, "lane": "1m",
                                 "lanes": ["200k", "1m"], "command": ["vllm", "serve", "m"], "starts": 4,
                                 "restarts": {"exit": 3, "guard": 0}, "restart_policy": "always",
                                 "backoff": 4.0, "consecutive_failures": 3, "last_exit": None})
    assert lines[0] == f"engine: backoff (lane 1m): {detail}"
    assert "  lanes: 200k, *1m" in lines
    assert any("restarts: exit 3" in ln for ln in lines)
    assert any("crash loop: 3 restarts in a row" in ln for ln in lines)
    assert render.describe(None)[0].startswith("engine: not supervised")


def test_describe_says_the_pid_and_lane_once():
    ready = {"state": "ready", "detail": "", "pid": 27228, "lane": "calm", "uptime": 11.7, "starts": 1,
             "restarts": {}, "restart_policy": "always"}
    assert render.describe(ready)[0] == "engine: ready (pid 27228, lane calm, up 11.7 s)"
    # a detail that only repeats what the parentheses say (an older daemon's) is left out
    assert render.describe({**ready, "detail": "pid 27228, lane calm"})[0] == \
        "engine: ready (pid 27228, lane calm, up 11.7 s)"
    starting = {**ready, "state": "starting", "detail": "waiting for http://127.0.0.1:8000/health to answer 200"}
    assert render.describe(starting)[0] == ("engine: starting (pid 27228, lane calm, up 11.7 s): "
                                                "waiting for http://127.0.0.1:8000/health to answer 200")


def test_exit_details_read_as_sentences():
    from sparkguard.supervisor.restart import describe_exit
    assert describe_exit(0, None, 9.94, None, True) == "exit code 0 after 9.9 s (guard: signalled by the memory guard)"
    assert describe_exit(None, "SIGKILL", 3.1, "lane", False) == "killed by SIGKILL after 3.1 s (lane: switching lanes)"
    assert describe_exit(1, None, 0.1, None, False) == "exit code 1 after 100 ms"
    assert describe_exit(0, None, 2.0, "stop", False) == "exit code 0 after 2.0 s (stop)"


# ---- config


def load(engine: dict, guard: dict | None = None) -> config.Config:
    data = {"engine": engine}
    if guard:
        data["guard"] = guard
    return config.from_dict(data, "/etc/sparkguard/sparkguard.yaml", mem_total=128 * GiB)


def err(engine: dict, guard: dict | None = None) -> str:
    with pytest.raises(config.ConfigError) as e:
        load(engine, guard)
    return str(e.value)


def test_no_engine_section_means_guard_only():
    cfg = config.from_dict({}, mem_total=128 * GiB)
    assert not cfg.engine.enabled and cfg.engine.command is None


def test_engine_defaults():
    e = load({"command": ["vllm", "serve", "m"]}).engine
    assert e.enabled and e.command == ("vllm", "serve", "m")
    assert e.restart == "always" and e.drop_caches and e.start_above == 4 * GiB
    assert e.control_socket == "/run/sparkguard/control.sock"
    assert e.state_file == "/var/lib/sparkguard/engine-state.json"
    assert e.lane is None and e.lanes == {} and e.probe is None


def test_lanes_and_probe_parse():
    e = load({"command": ["vllm", "serve", "m"], "health_url": "http://127.0.0.1:8000/health",
              "lanes": {"200k": {"args": ["--max-model-len", 200000, "--max-num-seqs", 15]},
                        "1m": {"args": ["--max-model-len", "1000000"], "env": {"VLLM_X": 1}}},
              "lane": "1m", "probe": {"interval": "30s", "failures": 2}}).engine
    assert e.lanes["200k"].args == ("--max-model-len", "200000", "--max-num-seqs", "15")
    assert e.lanes["1m"].env == {"VLLM_X": "1"}
    assert e.probe.interval == 30.0 and e.probe.failures == 2 and e.probe.timeout == 20.0


@pytest.mark.parametrize("engine,guard,expected", [
    ({"command": "vllm serve m"}, None,
     "engine.command: 'vllm serve m': expected a non-empty list of strings"),
    ({"command": []}, None, "engine.command: []: expected a non-empty list of strings"),
    ({"command": ["vllm", 3]}, None, "engine.command: ['vllm', 3]: expected a non-empty list of strings"),
    ({"health_url": "http://x/health"}, None,
     "engine.command: None: missing: engine.health_url is set but there is no command to start"),
    ({"command": ["e"], "lane": "1m"}, None, "engine.lane: '1m': no such lane; engine.lanes has none"),
    ({"command": ["e"], "lanes": {"a": {}}, "lane": "b"}, None, "engine.lane: 'b': no such lane; engine.lanes has a"),
    ({"command": ["e"], "lanes": {"a": {"argz": []}}}, None,
     "engine.lanes.a.argz: []: unknown key; expected one of args, env"),
    ({"command": ["e"], "lanes": {"a": {"env": {"BAD-NAME": 1}}}}, None,
     "engine.lanes.a.env.BAD-NAME: 1: not a valid environment variable name"),
    ({"command": ["e"], "start_above": "200GiB"}, None, "engine.start_above: '200GiB': is not below MemTotal"),
    ({"command": ["e"], "start_above": "lots"}, None, "engine.start_above: 'lots': expected a size like 0.75GiB"),
    ({"command": ["e"], "ready_timeout": "-5s"}, None, "engine.ready_timeout: '-5s': expected a duration"),
    ({"command": ["e"], "restart": "sometimes"}, None,
     "engine.restart: 'sometimes': expected one of always, on-failure, never"),
    ({"command": ["e"], "backoff_initial": "10s", "backoff_max": "1s"}, None,
     "engine.backoff_max: '1s': is below engine.backoff_initial (10 s)"),
    ({"command": ["e"], "probe": {"interval": "1s"}}, None,
     "engine.probe: {'interval': '1s'}: needs probe.url, or engine.health_url"),
    ({"command": ["e"], "probe": {"failures": 0}, "health_url": "http://h:1/health"}, None,
     "engine.probe.failures: 0: expected a whole number from 1 to 1000"),
    ({"command": ["e"], "peers": ["10.0.0.2:8799"]}, None,
     "engine.peers[0]: '10.0.0.2:8799': expected an http:// or https:// URL with a host"),
    ({"command": ["e"], "user": "no-such-user-sg"}, None, "engine.user: 'no-such-user-sg': no such user"),
    ({"command": ["e"], "cwd": "/no/such/dir"}, None, "engine.cwd: '/no/such/dir': not an existing directory"),
    ({"command": ["vllm", "serve", "m"], "env": {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": 30}}, {"grace": "20s"},
     "engine.env.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS: '30': the engine's shutdown timeout (30 s) must be shorter "
     "than guard.grace (20 s)"),
    ({"command": ["vllm", "serve", "m"], "lanes": {"x": {"args": ["--shutdown-timeout", "10"]}}}, None,
     "engine.lanes.x.args: '10': the engine's shutdown timeout (10 s) must be shorter than guard.grace (5 s)"),
    ({"command": ["e"], "shutdown_timeout": "12s"}, None,
     "engine.shutdown_timeout: 12.0: the engine's shutdown timeout (12 s) must be shorter than guard.grace"),
])
def test_engine_config_errors_name_file_key_and_value(engine, guard, expected):
    msg = err(engine, guard)
    assert msg.startswith("/etc/sparkguard/sparkguard.yaml: ")
    assert expected in msg, msg


def test_vllm_detection_and_shutdown_timeout_default():
    assert config.is_vllm(["vllm", "serve", "m"])
    assert config.is_vllm(["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"])
    assert config.is_vllm(["python3", "-m", "vllm.entrypoints.openai.api_server"])
    assert not config.is_vllm(["python3", "-m", "sglang.launch_server"])
    assert config.vllm_shutdown_timeout(10.0) == 8
    assert config.vllm_shutdown_timeout(3.0) == 1
    assert config.vllm_shutdown_timeout(30.0) == 24
    assert config.vllm_shutdown_timeout(1.0) == 0


def test_check_config_reports_an_engine_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("engine:\n  command: [vllm, serve, m]\n  lanes: {200k: {args: []}}\n  lane: 1m\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"sparkguard: invalid config: {p}: engine.lane: '1m': no such lane; "
                                "engine.lanes has 200k")


def test_guard_only_file_may_spell_out_the_engine_defaults():
    cfg = load({"command": None, "restart": "always", "lanes": {}, "probe": None, "start_above": "4GiB"})
    assert not cfg.engine.enabled
    assert "engine.start_above is set but there is no command" in err({"command": None, "start_above": "8GiB"})


def test_check_config_prints_the_engine_line(tmp_path):
    p = tmp_path / "engine.yaml"
    p.write_text("engine:\n  command: [vllm, serve, 'my model', --port, '8000']\n"
                 "  health_url: http://127.0.0.1:8000/health\n"
                 "  lanes: {200k: {args: []}, 1m: {args: [--max-model-len, '1000000']}}\n  lane: 1m\n"
                 "  restart: on-failure\n  backoff_initial: 2s\n  backoff_max: 1m\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == ("  engine: vllm serve 'my model' --port 8000 (lane 1m of 200k, 1m); "
                                         "health http://127.0.0.1:8000/health; restart on-failure, backoff 2.0 s "
                                         "to 60.0 s")
    p.write_text("engine:\n  command: [/opt/engine]\n  restart: never\n")
    r = run_sparkguard("check-config", str(p))
    assert r.stdout.splitlines()[-1] == "  engine: /opt/engine; health none (ready once started); restart never"
    p.write_text("guard:\n  grace: 5s\n")
    assert "  engine:" not in run_sparkguard("check-config", str(p)).stdout


def test_check_config_says_where_a_node_stands_in_its_tp_cluster(tmp_path):
    """A TP node's place from its command, and a warning when engine.peers cannot let the nodes
    recover as one engine (every other node must be listed)."""
    p = tmp_path / "tp.yaml"
    cmd = "[vllm, serve, m, --tensor-parallel-size, '4', --nnodes, '4', --node-rank, '2', --headless]"
    p.write_text(f"engine:\n  command: {cmd}\n  peers: [http://10.0.0.1:8799, http://10.0.0.2:8799]\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith("  TP cluster: headless, node rank 2 of 4 nodes; peers: 2; WARNING:"), last
    assert "each of the 3 other node(s)" in last
    p.write_text(f"engine:\n  command: {cmd}\n  peers: [http://10.0.0.1:8799, http://10.0.0.2:8799, "
                 "http://10.0.0.4:8799]\n")
    last = run_sparkguard("check-config", str(p)).stdout.splitlines()[-1]
    assert last == "  TP cluster: headless, node rank 2 of 4 nodes; peers: 3 (the 3 other nodes)", last


def test_default_config_file_explains_every_engine_key_in_one_line():
    """``sparkguard install`` writes the defaults with a comment per key; the engine's keys too
    (the file must still load to exactly the defaults: render() checks that itself)."""
    import yaml

    from sparkguard.host import configfile
    text = configfile.render()
    assert config.from_dict(yaml.safe_load(text), "x").engine == config.EngineConfig()
    lines = text.splitlines()
    head = lines.index("engine:")
    assert lines[head - 1].startswith("# ")
    keys = list(config.SCHEMA["engine"][1])
    at = {ln.split(":", 1)[0].strip(): i for i, ln in enumerate(lines[head + 1:], head + 1)
          if ln.startswith("  ") and not ln.startswith("  #") and not ln.startswith("  -")}
    for key in keys:
        i = at[key]
        assert lines[i - 1].startswith("  # ") and len(lines[i - 1]) > 12, (key, lines[i - 1])
        j = i - 2
        while j > head and lines[j].startswith("    "):      # the previous key's nested mapping
            j -= 1
        assert lines[j].startswith(f"  {keys[keys.index(key) - 1]}:") or key == keys[0], \
            f"engine.{key}: the comment takes more than one line"

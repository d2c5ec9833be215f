"""A container engine's command line read as docker's and podman's own parser (pflag) reads it: no CLI call.

The table's lines are the public recipes' command lines (docs/containers.md, FIELD-NOTES "What the
public multi-Spark recipes do") and the spellings pflag accepts for them: global options before
the verb, ``container run``, short clusters with attached values, ``--flag=value``, ``--``, an
``env`` wrapper.  Each line says which image and inner command the parse must find, and
:func:`container.prepare` must insert its options right after the verb, leaving the rest as written.
"""

from __future__ import annotations

import re

import pytest

from sparkguard.supervisor import container, container_argv

IMG = "vllm/vllm-openai:latest"
SERVE = ["vllm", "serve", "/models/GLM-5.3", "--tensor-parallel-size", "2"]
#: the docs' single-node recipe, as written there
SINGLE = ["--gpus", "all", "--network", "host", "--ipc", "host", "--shm-size", "16g", "-v", "/models:/models",
          "--rm"]
#: the docs' rank-1 recipe (no Ray), as written there
RANK1 = ["--gpus", "all", "--network", "host", "--ipc", "host", "--name", "vllm-rank1",
         "-e", "NCCL_SOCKET_IFNAME=enp1s0f0np0", "-v", "/models:/models"]
RANK1_SERVE = ["vllm", "serve", "/models/GLM-5.3", "--tensor-parallel-size", "2", "--distributed-executor-backend",
               "mp", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--headless"]

# (argv, the CLI's global options, the words before the options, the user's --name, the inner command)
LINES = [
    (["docker", "run", *SINGLE, IMG, *SERVE], [], ["docker", "run"], None, SERVE),
    (["docker", "run", *RANK1, IMG, *RANK1_SERVE], [], ["docker", "run"], "vllm-rank1", RANK1_SERVE),
    (["docker", "container", "run", *SINGLE, IMG, *SERVE], [], ["docker", "container", "run"], None, SERVE),
    (["/usr/bin/docker", "-H", "unix:///run/x.sock", "run", *SINGLE, IMG, *SERVE], ["-H", "unix:///run/x.sock"],
     ["/usr/bin/docker", "-H", "unix:///run/x.sock", "run"], None, SERVE),
    (["docker", "--host=tcp://10.0.0.2:2375", "run", "--name=glm", IMG, *SERVE], ["--host=tcp://10.0.0.2:2375"],
     ["docker", "--host=tcp://10.0.0.2:2375", "run"], "glm", SERVE),
    (["docker", "--context", "spark2", "-l", "warn", "container", "run", IMG, *SERVE],
     ["--context", "spark2", "-l", "warn"], ["docker", "--context", "spark2", "-l", "warn", "container", "run"],
     None, SERVE),
    (["docker", "-c", "spark2", "--config", "/etc/docker-cli", "--log-level=error", "-D", "run", IMG, *SERVE],
     ["-c", "spark2", "--config", "/etc/docker-cli", "--log-level=error", "-D"],
     ["docker", "-c", "spark2", "--config", "/etc/docker-cli", "--log-level=error", "-D", "run"], None, SERVE),
    (["docker", "--tlsverify", "--tlscacert", "/ca.pem", "run", IMG, *SERVE], ["--tlsverify", "--tlscacert", "/ca.pem"],
     ["docker", "--tlsverify", "--tlscacert", "/ca.pem", "run"], None, SERVE),
    # short clusters and attached values: -it, -p8000:8000, -v/models:/models, -eFOO=1, -e=BAR=2, -u0
    (["docker", "run", "-ti=false", "-p8000:8000", "-v/models:/models", "-eFOO=1", "-e=BAR=2", "-u0", "-w/work",
      "--rm=false", "--detach=false", IMG, *SERVE], [], ["docker", "run"], None, SERVE),
    (["docker", "run", "-tv", "/models:/models", IMG, *SERVE], [], ["docker", "run"], None, SERVE),   # -t, then -v's value
    (["docker", "run", "--rm", "--", IMG, *SERVE], [], ["docker", "run"], None, SERVE),
    (["docker", "run", "--rm", "--", "-odd-image", "serve"], [], ["docker", "run"], None, ["serve"]),
    (["docker", "run", "--init", "--privileged", "--read-only", "--sig-proxy", "--oom-kill-disable", "-P", "-q",
      "--no-healthcheck", "--use-api-socket", IMG, *SERVE], [], ["docker", "run"], None, SERVE),
    # podman: its globals (--remote is a bool, --url / --root / -c take a value) and its own bool run options
    (["podman", "--remote", "--url", "unix:///run/podman/podman.sock", "run", "--replace", "--name", "glm",
      "--env-host", "--no-hosts", "--tls-verify=false", IMG, *SERVE],
     ["--remote", "--url", "unix:///run/podman/podman.sock"],
     ["podman", "--remote", "--url", "unix:///run/podman/podman.sock", "run"], "glm", SERVE),
    (["podman", "run", "-it", IMG, *SERVE], [], ["podman", "run"], None, SERVE),     # podman only warns
    (["podman", "--root", "/var/lib/c", "--runroot=/run/c", "-r", "container", "run", IMG, *SERVE],
     ["--root", "/var/lib/c", "--runroot=/run/c", "-r"],
     ["podman", "--root", "/var/lib/c", "--runroot=/run/c", "-r", "container", "run"], None, SERVE),
    # env(1) in front: its assignments are the client's
    (["env", "DOCKER_HOST=unix:///y.sock", "docker", "run", IMG, *SERVE], [],
     ["env", "DOCKER_HOST=unix:///y.sock", "docker", "run"], None, SERVE),
    (["/usr/bin/env", "-u", "DOCKER_CONTEXT", "A=1", "--", "docker", "-H", "unix:///z", "run", IMG, *SERVE],
     ["-H", "unix:///z"], ["/usr/bin/env", "-u", "DOCKER_CONTEXT", "A=1", "--", "docker", "-H", "unix:///z", "run"],
     None, SERVE),
]


@pytest.mark.parametrize("argv,glob,head,name,inner", LINES, ids=[" ".join(x[0][:5]) for x in LINES])
def test_a_recipe_command_line_is_read_as_the_cli_reads_it(tmp_path, argv, glob, head, name, inner):
    cmd = container_argv.parse(argv)
    assert cmd is not None and cmd.image in (IMG, "-odd-image") and cmd.inner == inner
    assert cmd.global_opts == glob and argv[:cmd.at] == head and cmd.value("name") == name
    out, launch = container.prepare(argv, {"DOCKER_HOST": "unix:///base.sock"}, str(tmp_path), 8)
    assert out[:len(head)] == head and out[len(head):len(head) + 2] == ["--cidfile", launch.cidfile]
    assert out[-len(argv) + len(head):] == argv[len(head):], "the user's options must stay as written"
    assert launch.global_opts == glob and (launch.name is None) == (name is not None) and launch.user_name == name
    assert ("--rm" in out[len(head):len(out) - len(argv) + len(head)]) == (not cmd.has("rm"))
    assert container_argv.parse(out).inner == inner and container_argv.parse(out).value("cidfile") == launch.cidfile


def test_the_env_wrapper_sets_the_client_environment_and_sparkguards_cli_calls(tmp_path):
    argv = ["env", "-u", "DOCKER_CONTEXT", "DOCKER_HOST=unix:///y.sock", "docker", "-H", "unix:///y.sock", "run",
            IMG, *SERVE]
    _, launch = container.prepare(argv, {"DOCKER_HOST": "unix:///base.sock", "DOCKER_CONTEXT": "c", "PATH": "/bin"},
                                  str(tmp_path), 8)
    assert launch.env == {"DOCKER_HOST": "unix:///y.sock", "PATH": "/bin"}
    assert launch.runtime == "docker" and launch.global_opts == ["-H", "unix:///y.sock"]
    _, clear = container.prepare(["env", "-i", "A=1", "docker", "run", IMG], {"PATH": "/bin"}, str(tmp_path), 8)
    assert clear.env == {"A": "1"}


def test_sparkguards_own_cli_calls_carry_the_global_options(tmp_path):
    # a stand-in CLI that prints its argv: `inspect` must go to the daemon the client talks to
    cli = tmp_path / "docker"
    cli.write_text("#!/bin/sh\necho \"$@\" > \"$0.args\"\nexit 1\n")
    cli.chmod(0o755)
    _, launch = container.prepare([str(cli), "--context", "spark2", "run", IMG], {}, str(tmp_path / "c"), 8)
    assert container.inspect(launch, "abc") is None
    assert (tmp_path / "docker.args").read_text().split() == ["--context", "spark2", "container", "inspect", "abc"]


@pytest.mark.parametrize("bad,why", [
    (["-d"], "-d detaches"), (["-dit"], "-d detaches"), (["-itd"], "-d detaches"), (["--detach"], "-d detaches"),
    (["--detach=true"], "-d detaches"), (["-it"], "docker run -it: docker refuses -i with -t"),
    (["-i", "--tty"], "docker run -it: docker refuses"), (["-d=1"], "-d detaches"), (["--detach=maybe"], "--detach=maybe: not a bool"),
    (["--sig-proxy=false"], "--sig-proxy=false"), (["--sig-proxy=0"], "--sig-proxy=false"),
    (["--cidfile", "/x"], "--cidfile"), (["--cidfile=/x"], "--cidfile"),
    (["--restart", "unless-stopped"], "--restart unless-stopped"), (["--restart=always"], "--restart always"),
    (["-x"], "unknown shorthand flag 'x' in -x"), (["-itx"], "unknown shorthand flag 'x' in -itx"),
])
def test_what_would_hide_the_engine_or_that_docker_would_refuse_is_refused(tmp_path, bad, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        container.prepare(["docker", "run", *bad, IMG, *SERVE], {}, str(tmp_path))


@pytest.mark.parametrize("argv,why", [
    (["sudo", "docker", "run", IMG], "sudo before the container CLI"),
    (["sudo", "-u", "vllm", "docker", "run", IMG], "sudo before the container CLI"),
    (["doas", "podman", "run", IMG], "doas before the container CLI"),
    (["env", "-C", "/tmp", "docker", "run", IMG], "env -C: sparkguard reads only"),
    (["docker", "--version", "run", IMG], "docker --version: prints and exits"),
    (["docker", "run", "--rm"], "no image after the options --rm"),
    (["docker", "run", "-e"], "flag needs an argument: -e"),
    (["docker", "run", "--name"], "flag needs an argument: --name"),
])
def test_a_command_line_it_cannot_run_as_a_tracked_container_is_refused_clearly(tmp_path, argv, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        container.prepare(argv, {}, str(tmp_path))


@pytest.mark.parametrize("argv", [
    ["vllm", "serve", "m"], ["docker", "exec", "x", "vllm"], ["/usr/bin/python3", "docker", "run"],
    ["docker", "container", "ls"], ["env", "A=1", "vllm", "serve", "m"], ["sudo", "vllm", "serve", "m"],
    ["docker", "-H", "unix:///x", "ps"],
])
def test_not_a_container_run_is_left_alone(tmp_path, argv):
    assert container.prepare(argv, {}, str(tmp_path)) == (argv, None)
    assert container_argv.runtime_of(argv) is None and container_argv.inner(argv) == []


@pytest.mark.parametrize("cmd,why", [
    (["docker", "run", "-d", IMG], "docker run -d detaches"),
    (["docker", "-H", "unix:///x", "container", "run", "-it", IMG], "docker run -it"),
    (["sudo", "docker", "run", IMG], "sudo before the container CLI"),
    (["docker", "run", "--restart=always", IMG], "--restart always"),
])
def test_a_refused_container_command_is_a_config_error_naming_file_key_and_value(tmp_path, cmd, why):
    from sparkguard.config import ConfigError, load
    f = tmp_path / "sparkguard.yaml"
    f.write_text("engine:\n  command: " + repr(cmd).replace("'", '"') + "\n")
    with pytest.raises(ConfigError) as e:
        load(str(f), mem_total=64 * 1024 ** 3)
    assert e.value.path == str(f) and e.value.key == "engine.command" and list(e.value.value) == cmd
    assert why in str(e.value)
    f.write_text("engine:\n  command: " + repr(["docker", "run", "-t", IMG]).replace("'", '"') + "\n")
    assert load(str(f), mem_total=64 * 1024 ** 3).engine.command[:3] == ("docker", "run", "-t")

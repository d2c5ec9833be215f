"""The command line of a container engine: is it ``docker|podman [GLOBAL] [container] run``, its parts.

Pure functions of argv (no CLI call).  The parse follows the one the CLIs do, spf13/pflag's
(``flag.go`` ``parseLongArg``, ``parseSingleShortArg``, ``parseShortArg``, read at commit
5fdac2d1) under cobra with interspersed flags off for ``run`` (the first non-option is the image):

* ``--flag=value``; ``--flag value`` for a flag that takes a value; a bool flag takes no next
  argument, only ``--flag=false``;
* a short cluster ``-dit`` is read letter by letter: a bool letter takes no value and the next
  letter follows; a value letter takes the rest of the cluster (``-p8000:8000``,
  ``-v/models:/models``, ``-eFOO=1``) or, at the end, the next argument; ``-e=FOO=1`` is the
  value ``FOO=1``;
* ``--`` ends the options (the next argument is the image); an unknown short letter is an error.

Flag tables, read from the sources:

* docker global options: docker/cli ``cli/flags/options.go`` ``InstallFlags`` and
  ``cmd/docker/docker.go`` (``-v``/``--version``), commit 28f75608;
* docker run options: ``cli/command/container/opts.go`` ``addFlags`` and ``run.go``;
* podman global options: containers/podman ``cmd/podman/root.go`` ``rootFlags``, commit c6580b4a;
* podman run options: ``cmd/podman/common/create.go`` ``DefineCreateFlags``,
  ``cmd/podman/common/netflags.go`` and ``cmd/podman/containers/run.go``.

A long run option missing from the bool tables is taken to take a value (most do; assumption:
the recipes' command lines use no other bool option).  An unknown global option without ``=`` is
taken to take a value unless the next argument is the verb (``run``, ``container``).

Wrappers: ``env [-i] [-u NAME] [NAME=VALUE...] docker run ...`` is recognised (env(1) execs the
CLI: same pid; its assignments join the client's environment and sparkguard's own CLI calls).
``sudo``/``doas`` before the CLI are refused (:data:`REFUSED_WRAPPERS`): the process sparkguard
would track and signal is sudo's, which relays signals only while it runs, and the daemon already
runs as root or as ``engine.user``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

RUNTIMES = ("docker", "podman")
#: wrappers that are refused before a container CLI (module doc); the message says what to write instead
REFUSED_WRAPPERS = ("sudo", "doas")

#: run options' short letters -> long names (docker's and podman's are the same letters)
RUN_SHORT = {"a": "attach", "c": "cpu-shares", "d": "detach", "e": "env", "h": "hostname", "i": "interactive",
             "l": "label", "m": "memory", "p": "publish", "P": "publish-all", "q": "quiet", "t": "tty",
             "u": "user", "v": "volume", "w": "workdir"}
#: run options that take no value (``--opt=false`` only); docker's, then podman's own
RUN_BOOL = frozenset({
    "detach", "interactive", "tty", "rm", "init", "privileged", "publish-all", "read-only", "no-healthcheck",
    "oom-kill-disable", "sig-proxy", "disable-content-trust", "quiet", "help", "use-api-socket",
    "replace", "rmi", "env-host", "http-proxy", "no-hosts", "no-hostname", "read-only-tmpfs", "rootfs",
    "tls-verify", "unsetenv-all", "passwd",
})
#: global options (before the verb): short letters -> long names, and the bool ones, per CLI
GLOBAL_SHORT = {"docker": {"c": "context", "D": "debug", "H": "host", "l": "log-level", "v": "version", "h": "help"},
                "podman": {"c": "connection", "D": "debug", "H": "host", "r": "remote", "v": "version", "h": "help"}}
GLOBAL_BOOL = {"docker": frozenset({"debug", "tls", "tlsverify", "version", "help"}),
               "podman": frozenset({"debug", "help", "noout", "remote", "syslog", "trace", "transient-store",
                                    "version"})}
#: global options known to take a value (the rest of the globals not in GLOBAL_BOOL are unknown)
GLOBAL_VALUE = {
    "docker": frozenset({"config", "context", "host", "log-level", "tlscacert", "tlscert", "tlskey"}),
    "podman": frozenset({"cdi-spec-dir", "cgroup-manager", "config", "conmon", "connection", "context",
                         "cpu-profile", "default-mounts-file", "events-backend", "hooks-dir", "host", "identity",
                         "imagestore", "log-level", "max-workers", "memory-profile", "module", "namespace",
                         "network-backend", "network-cmd-path", "network-config-dir", "out", "pull-option",
                         "registries-conf", "root", "runroot", "runtime", "runtime-flag", "ssh", "storage-driver",
                         "storage-opt", "tls-ca", "tls-cert", "tls-details", "tls-key", "tmpdir", "url",
                         "volumepath", "db-backend"}),
}
#: global options that print and exit: the verb never runs
GLOBAL_EXIT = frozenset({"version", "help"})
VERBS = ("run", "container")

#: strconv.ParseBool's spellings (what pflag's bool flags accept)
TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


@dataclass
class Command:
    """A parsed ``docker|podman run`` command line.

    Attributes:
        runtime: str, the CLI as written (``docker``, ``/usr/bin/podman``).
        kind: str, ``"docker"`` or ``"podman"`` (whose flag tables apply).
        cli_at: int, its index in argv (after an ``env`` wrapper).
        env: dict, the ``NAME=VALUE`` assignments of an ``env`` wrapper.
        env_clear: bool, the wrapper starts from an empty environment (``env -i``).
        env_unset: list[str], names the wrapper removes (``env -u NAME``).
        global_opts: list[str], the options between the CLI and the verb, as written (they pick
            the daemon: ``-H``, ``--context``, podman's ``--url``, ``--root``...).
        at: int, the index right after the verb (``run``): where options can be inserted.
        opts: list[str], the run options as written, up to the image (``--`` excluded).
        flags: list[tuple[str, str]], each run option as ``(long name, value)``; a bool's value is
            ``"true"``/``"false"`` as written (``--rm`` -> ``"true"``).
        image: str.  inner: list[str], the command run inside the container (may be empty).
    """

    runtime: str
    kind: str = "docker"
    cli_at: int = 0
    env: dict = field(default_factory=dict)
    env_clear: bool = False
    env_unset: list = field(default_factory=list)
    global_opts: list = field(default_factory=list)
    at: int = 0
    opts: list = field(default_factory=list)
    flags: list = field(default_factory=list)
    image: str = ""
    inner: list = field(default_factory=list)

    def has(self, name: str) -> bool:
        """True when run option ``--name`` (or its short letter) was given, whatever its value."""
        return any(n == name for n, _ in self.flags)

    def value(self, name: str) -> str | None:
        """The last value given to run option ``--name`` (docker keeps the last one), None if absent."""
        vals = [v for n, v in self.flags if n == name]
        return vals[-1] if vals else None

    def true(self, name: str) -> bool:
        """True when bool run option ``--name`` is on (its last value).  Raises ValueError on a
        value pflag's bool parse (strconv.ParseBool) would refuse."""
        v = self.value(name)
        if v is None:
            return False
        if v in TRUE:
            return True
        if v in FALSE:
            return False
        raise ValueError(f"{self.runtime} run --{name}={v}: not a bool (true or false)")

    def client_env(self, env: dict) -> dict:
        """``env`` (the environment sparkguard gives the command) as the wrapper changes it: the
        environment the CLI itself runs with."""
        out = {} if self.env_clear else dict(env)
        for k in self.env_unset:
            out.pop(k, None)
        out.update(self.env)
        return out


def _wrapper(argv: list[str]) -> tuple[int, dict, bool, list[str]] | None:
    """Skip an ``env`` wrapper: ``(index of the next word, assignments, -i, unset names)``; None
    when argv[0] is not env(1).  Raises ValueError on an env option it does not read."""
    if os.path.basename(argv[0]) != "env":
        return None
    i, assign, clear, unset = 1, {}, False, []
    while i < len(argv):
        a = argv[i]
        if a in ("-i", "--ignore-environment", "-"):
            clear = True
        elif a in ("-u", "--unset") and i + 1 < len(argv):
            unset.append(argv[i + 1])
            i += 1
        elif a.startswith("--unset="):
            unset.append(a.split("=", 1)[1])
        elif a.startswith("-u") and len(a) > 2:
            unset.append(a[2:])
        elif a == "--":
            i += 1
            break
        elif a.startswith("-"):
            raise ValueError(f"env {a}: sparkguard reads only env's NAME=VALUE, -i and -u before {RUNTIMES[0]}; "
                             "set the rest with engine.env / engine.cwd")
        elif "=" in a:
            k, v = a.split("=", 1)
            assign[k] = v
        else:
            break
        i += 1
    return i, assign, clear, unset


def _cli_index(argv: list[str]) -> tuple[int, dict, bool, list[str]] | None:
    """Where the container CLI is in ``argv``: ``(index, env assignments, -i, unset)``, None when
    there is none.  Raises ValueError for a refused wrapper in front of it."""
    if not argv:
        return None
    base = os.path.basename(argv[0])
    if base in REFUSED_WRAPPERS:
        if any(os.path.basename(a) in RUNTIMES for a in argv[1:]):
            raise ValueError(f"{base} before the container CLI: sparkguard would track and signal {base}, not the "
                             "client; remove it (the daemon runs as root; engine.user runs the client as another "
                             "user, env(1) sets its environment)")
        return None
    w = _wrapper(argv)
    if w is None:
        return (0, {}, False, []) if base in RUNTIMES else None
    i = w[0]
    if i < len(argv) and os.path.basename(argv[i]) in RUNTIMES:
        return w
    return None


def _short_cluster(arg: str, rest: list[str], short: dict, bools: frozenset, what: str) -> tuple[list, int]:
    """pflag's short cluster (module doc): ``([(long name, value)...], extra arguments used)``.
    Raises ValueError on an unknown letter or a missing value."""
    out, s = [], arg[1:]
    while s:
        c = s[0]
        name = short.get(c)
        if name is None:
            raise ValueError(f"{what}: unknown shorthand flag {c!r} in {arg}")
        if len(s) > 2 and s[1] == "=":
            out.append((name, s[2:]))
            return out, 0
        if name in bools:
            out.append((name, "true"))
            s = s[1:]
            continue
        if len(s) > 1:
            out.append((name, s[1:]))
            return out, 0
        if not rest:
            raise ValueError(f"{what}: flag needs an argument: {arg}")
        out.append((name, rest[0]))
        return out, 1
    return out, 0


def _long(arg: str, rest: list[str], bools: frozenset, what: str,
          known_value: frozenset | None = None) -> tuple[tuple[str, str], int]:
    """pflag's long option: ``((name, value), extra arguments used)``.  A name in ``bools`` takes
    no next argument; ``known_value`` (globals): unknown names take one unless it is a verb."""
    name, eq, val = arg[2:].partition("=")
    if not name:
        raise ValueError(f"{what}: bad flag syntax: {arg}")
    if eq:
        return (name, val), 0
    if name in bools:
        return (name, "true"), 0
    if known_value is not None and name not in known_value and rest and rest[0] in VERBS:
        return (name, "true"), 0
    if not rest:
        raise ValueError(f"{what}: flag needs an argument: {arg}")
    return (name, rest[0]), 1


def parse(argv: list[str]) -> Command | None:
    """Read ``argv`` as ``[env ...] docker|podman [GLOBAL...] [container] run [OPTIONS] [--] IMAGE [CMD...]``.

    Returns:
        :class:`Command`, or None when argv runs no container CLI's ``run`` (``docker exec``,
        ``vllm serve``...).
    Raises:
        ValueError: a refused wrapper (sudo), an unknown short letter, a flag without its value,
            a global option that exits (``--version``), no image: the message names the argument.
    """
    found = _cli_index(argv)
    if found is None:
        return None
    at, assign, clear, unset = found
    rt = argv[at]
    kind = "podman" if "podman" in os.path.basename(rt) else "docker"
    i = at + 1
    glob: list[tuple[str, str]] = []
    what = f"{rt} (global options)"
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        a = argv[i]
        if a == "--":
            return None
        if a.startswith("--"):
            got, used = _long(a, argv[i + 1:], GLOBAL_BOOL[kind], what, GLOBAL_VALUE[kind])
            glob.append(got)
        else:
            got, used = _short_cluster(a, argv[i + 1:], GLOBAL_SHORT[kind], GLOBAL_BOOL[kind], what)
            glob += got
        i += 1 + used
    verb_at = i
    if i < len(argv) and argv[i] == "container":
        i += 1
    if i >= len(argv) or argv[i] != "run":
        return None
    stop = [n for n, v in glob if n in GLOBAL_EXIT and v in TRUE]
    if stop:
        raise ValueError(f"{rt} --{stop[0]}: prints and exits, the container never runs; remove it")
    cmd = Command(rt, kind, at, assign, clear, unset, argv[at + 1:verb_at], i + 1)
    i += 1
    what = f"{rt} run"
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a.startswith("--"):
            got, used = _long(a, argv[i + 1:], RUN_BOOL, what)
            cmd.flags.append(got)
        else:
            got, used = _short_cluster(a, argv[i + 1:], RUN_SHORT, RUN_BOOL, what)
            cmd.flags += got
        cmd.opts += argv[i:i + 1 + used]
        i += 1 + used
    if i >= len(argv):
        raise ValueError(f"{what}: no image after the options {' '.join(cmd.opts) or '(none)'}")
    cmd.image, cmd.inner = argv[i], argv[i + 1:]
    return cmd


def runtime_of(argv: list[str]) -> str | None:
    """The CLI as written when ``argv`` is a container ``run`` (:func:`parse`), else None (also when
    it cannot be parsed)."""
    try:
        cmd = parse(argv)
    except ValueError:
        return None
    return cmd.runtime if cmd is not None else None


def inner(argv: list[str]) -> list[str]:
    """The command run inside the container (what follows the image); [] when argv is no container
    ``run`` or cannot be parsed."""
    try:
        cmd = parse(argv)
    except ValueError:
        return []
    return cmd.inner if cmd is not None else []


def refusal(cmd: Command) -> str | None:
    """Why sparkguard cannot supervise container command ``cmd`` as written (one line: what and
    what to write instead), None when it can.  Checked at config load (``engine.command``) and at
    every start.

    Refused: ``-d``/``--detach`` (the client exits at once, which would read as the engine's
    exit); docker's ``-i`` with ``-t`` (docker/cli ``cli/command/container/run.go``
    ``runContainer`` -> ``cli/streams/in.go`` ``CheckTty``: stdin attached with a TTY needs a
    terminal, the engine's stdin is /dev/null; podman only warns: ``cmd/podman/containers/run.go``);
    ``--sig-proxy=false`` (the client's SIGTERM would not reach the engine); ``--cidfile``
    (sparkguard sets its own); a ``--restart`` policy other than ``no`` (the runtime would start
    the engine again behind sparkguard, with no memory gate).

    Raises:
        ValueError: a bool option with a value pflag would refuse (:meth:`Command.true`).
    """
    rt = cmd.runtime
    if cmd.true("detach"):
        return (f"{rt} run -d detaches: the client exits at once and sparkguard would take that for the "
                "engine's exit; remove -d (sparkguard runs the attached client)")
    if cmd.has("sig-proxy") and not cmd.true("sig-proxy"):
        return (f"{rt} run --sig-proxy=false: the SIGTERM sparkguard sends the client would not reach the "
                "engine; remove it")
    if cmd.kind == "docker" and cmd.true("interactive") and cmd.true("tty"):
        return (f"{rt} run -it: docker refuses -i with -t when stdin is no terminal (\"the input device is not a "
                "TTY\"), and sparkguard runs the client with stdin /dev/null; drop -i or -t (-t alone, or neither: "
                "the output reaches the journal either way)")
    if cmd.has("cidfile"):
        return f"{rt} run --cidfile: sparkguard sets its own cidfile; remove it"
    restart = cmd.value("restart")
    if restart not in (None, "no"):
        return (f"{rt} run --restart {restart}: {rt} would start the engine again behind sparkguard, with no "
                "memory gate; sparkguard restarts it (engine.backoff_*): remove --restart")
    return None

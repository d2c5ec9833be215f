"""The command line of a container engine: is it ``docker|podman run``, its options, its image, its command.

Pure functions of argv (no CLI call).  Flag names are docker-run(1)'s and podman-run(1)'s.
"""

from __future__ import annotations

import os

RUNTIMES = ("docker", "podman")


def runtime_of(argv: list[str]) -> str | None:
    """``argv[0]`` when ``argv`` is ``[docker|podman, run, ...]`` (any path to the CLI), else None."""
    if len(argv) >= 2 and os.path.basename(argv[0]) in RUNTIMES and argv[1] == "run":
        return argv[0]
    return None


def options(argv: list[str]) -> list[str]:
    """The ``run`` options before the image: every argument up to the first one that is not an
    option or an option's value.  A value-taking option written ``--opt value`` is recognised by
    docker-run(1)'s flag set being mostly value-taking: anything not in :data:`BOOL_FLAGS` takes one."""
    out, i = [], 2
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-") or a == "--":
            break
        out.append(a)
        if "=" not in a and a not in BOOL_FLAGS and not (len(a) > 2 and a[1] != "-" and set(a[1:]) <= BOOL_SHORT):
            if i + 1 < len(argv):
                out.append(argv[i + 1])
            i += 1
        i += 1
    return out


#: docker-run(1) / podman-run(1) options that take no value (the rest of their options take one);
#: an option missing here that takes no value makes the image look like its value (assumption: the
#: recipes' command lines use only these)
BOOL_FLAGS = frozenset({
    "-d", "--detach", "-i", "--interactive", "-t", "--tty", "--rm", "--init", "--privileged",
    "-P", "--publish-all", "--read-only", "--no-healthcheck", "--oom-kill-disable", "--sig-proxy",
    "--disable-content-trust", "-q", "--quiet", "--help",
    # podman's own
    "--replace", "--rmi", "--env-host", "--http-proxy", "--no-hosts", "--read-only-tmpfs", "--rootfs",
    "--tls-verify", "--unsetenv-all", "--passwd",
})
BOOL_SHORT = frozenset("ditPq")


def inner(argv: list[str]) -> list[str]:
    """The command run inside the container: what follows the image in ``[docker, run, OPTIONS, IMAGE, ...]``."""
    return argv[2 + len(options(argv)) + 1:]


def value(opts: list[str], flag: str) -> str | None:
    """The value of ``flag`` in :func:`options`' list (``--flag V`` or ``--flag=V``), None if absent."""
    for i, o in enumerate(opts):
        if o == flag and i + 1 < len(opts):
            return opts[i + 1]
        if o.startswith(flag + "="):
            return o.split("=", 1)[1]
    return None

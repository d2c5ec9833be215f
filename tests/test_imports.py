"""The package's import graph, read from the source: no import circle, imports at the top of modules.

The graph is built with :mod:`ast` from every ``sparkguard/**/*.py`` (nothing is imported).  An
edge ``a -> b`` means module ``a`` has an import statement that loads ``b``: ``import x.y.z`` and
``from x.y import z`` load ``x``, ``x.y`` and ``x.y.z`` (a package's ``__init__`` runs before its
modules), wherever the statement stands; an import inside a function is an edge too, because it
runs as soon as the function does.  A module's own enclosing packages are no edge of it: they are
initialised before it runs, so a package ``__init__`` that imports its modules (its public API)
makes no circle with them; a module taking a name from its own package's ``__init__``
(``from x.y import Name`` inside ``x.y.z``) still is an edge.

Imports inside functions are allowed only where the command line picks a command: the modules
and ``module:function`` entries in :data:`ALLOWED_LAZY` (``cli.py`` imports its commands through
:mod:`importlib`, which is no import statement, so it needs no entry).  Only sparkguard's own
modules are checked: :mod:`sparkguard.linkwatch` loads pyroute2 and asyncio (about 19 MiB) only
when a ``link:`` section is configured.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import ROOT, sg_env

#: module or "module:function" whose imports inside functions are CLI command selection
ALLOWED_LAZY = [
    "sparkguard.host.cli",      # install, uninstall, install-zram, tune, doctor: each handler imports its module
    "sparkguard.drill:cmd_drill",   # the drill's run (the whole guard) loads once the command runs, not in
                                    # the drill's own tree processes, which import sparkguard.drill.hog
    "sparkguard.incidents:_cmd",    # the configuration (and YAML) only when --dir is not given
]

PKG = ROOT / "sparkguard"


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The sparkguard modules an import statement in ``mod`` names (before adding parents)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        here = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
        here = here[:len(here) - node.level + 1]
        base = ".".join(here + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports(mod: str, named: bool = False) -> list[tuple[str, str | None, int]]:
    """Every sparkguard module ``mod``'s import statements load: ``(module, function, line)``,
    ``function`` the innermost enclosing function (None at module level or in a class body);
    ``named``: only the modules the statements name, not the packages above them."""
    out = []

    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, child):
                    parts = t.split(".")
                    for i in range(len(parts) if named else 1, len(parts) + 1):
                        name = ".".join(parts[:i])
                        if i < len(parts) and mod.startswith(name + "."):
                            continue        # an enclosing package of mod, loaded before mod
                        if name in MODULES and name != mod:
                            out.append((name, func, child.lineno))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            walk(child, inner)

    walk(ast.parse(MODULES[mod].read_text(), str(MODULES[mod])), None)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_a_circle():
    """The circle finder on a small graph: a -> b -> c -> a is one circle, d -> a is none."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = {m: {t for t, _, _ in imports(m)} for m in MODULES}
    found = circles(graph)
    assert found == [], f"import circles: {found}"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_at_module_top(mod):
    """An import inside a function hides a dependency from the reader and from this graph's
    circle check; only the command line's choice of a command may import late."""
    lazy = [(t, f, line) for t, f, line in imports(mod, named=True)
            if f is not None and mod not in ALLOWED_LAZY and f"{mod}:{f}" not in ALLOWED_LAZY]
    assert lazy == [], f"{mod}: imports inside functions (module, function, line): {lazy}"


def test_every_command_is_in_the_command_table():
    """cli.COMMANDS names the module of every command that module registers, so that the chosen
    command's module alone is imported."""
    from sparkguard import cli
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)
    for name in cli.COMMAND_MODULES:
        one = cli.build_parser([next(c for c, m in cli.COMMANDS.items() if m == name)])
        got = next(a for a in one._actions if a.dest == "command").choices
        assert sorted(got) == sorted(c for c, m in cli.COMMANDS.items() if m == name), name


def test_a_command_imports_only_its_module():
    """``sparkguard engine ...`` loads the control client and not the daemon (measured in a
    fresh interpreter: the modules loaded once the parser is built)."""
    code = ("import sys\nfrom sparkguard import cli\ncli.build_parser(['engine', 'status'])\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('sparkguard'))))\n")
    r = subprocess.run([sys.executable, "-c", code], env=sg_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert "sparkguard.control" in loaded
    assert not loaded & {"sparkguard.daemon", "sparkguard.drill", "sparkguard.supervisor.core"}, sorted(loaded)

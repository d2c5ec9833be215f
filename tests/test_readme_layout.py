"""The README's "Code layout" names every module of the package, and only modules that exist."""

from __future__ import annotations

import re

from conftest import ROOT


def layout_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Code layout\n", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in section.splitlines() if ln.startswith("| `")]


def named(rows: list[str]) -> set[str]:
    """Module paths (relative to sparkguard/) the rows name: ``dir/x.py`` as written, and a bare
    ``x.py`` (or ``__init__``) in a row whose first cell is ``dir/...`` or ``dir/``."""
    out = set()
    for row in rows:
        first = row.split("|")[1]
        folder = re.match(r"\s*`([a-z_]+)/", first)
        for name in re.findall(r"`([a-z_/]+\.py|__init__)`", row):
            if "/" in name:
                out.add(name)
            elif folder:
                out.add(f"{folder.group(1)}/{name if name.endswith('.py') else '__init__.py'}")
            else:
                out.add(name)
    return out


def test_every_module_is_in_the_code_layout_and_every_name_there_exists():
    files = {str(p.relative_to(ROOT / "sparkguard")) for p in (ROOT / "sparkguard").rglob("*.py")}
    implicit = {"__init__.py", "__main__.py", "guard/__init__.py", "host/__init__.py", "supervisor/__init__.py",
                "metrics/__init__.py", "config/__init__.py"}      # package files holding only their docstring/API
    names = named(layout_rows())
    assert sorted(files - implicit - names) == [], "modules the README's Code layout does not name"
    assert sorted(names - files) == [], "names in the README's Code layout that are no module"

"""sparkguard(8) and the shell completion are generated from the parser (sparkguard/docgen.py):
every command and option appears, groff renders the page without a warning, bash completes."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from conftest import run_sparkguard, sg_env
from sparkguard.cli import build_parser


def all_options() -> dict[str, list[str]]:
    """{command path: its long options} for every (sub-)command of the parser."""
    out: dict[str, list[str]] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        out[path] = [o for a in p._actions if a.help != argparse.SUPPRESS
                     for o in a.option_strings if o.startswith("--") and o != "--help"]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{path} {name}")

    walk(build_parser(None), "sparkguard")
    return out


def test_man_page_names_every_command_and_option_and_groff_accepts_it():
    pytest.importorskip("argparse_manpage", reason="argparse-manpage missing: pip install '.[man]'")
    r = run_sparkguard("man", env=sg_env(SOURCE_DATE_EPOCH="1796158800"))
    assert r.returncode == 0, r.stderr
    page = r.stdout
    assert page.startswith('.TH SPARKGUARD "8" "2026-12-01" "sparkguard ') and '"System Administration"' in page
    roff = page.replace("\\-", "-")
    for path, opts in all_options().items():
        assert f"'{path}'" in roff or path == "sparkguard", path
        for o in opts:
            assert o in roff, f"{path} {o} missing from the man page"
    if shutil.which("groff") is None:
        pytest.skip("groff missing (man-db depends on it)")
    g = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z"], input=page, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, LANG="C.UTF-8"))
    assert g.returncode == 0 and g.stderr == "", g.stderr


def test_man_page_has_no_date_without_source_date_epoch():
    pytest.importorskip("argparse_manpage")
    env = sg_env()
    env.pop("SOURCE_DATE_EPOCH", None)
    r = run_sparkguard("man", env=env)
    assert r.returncode == 0 and r.stdout.startswith('.TH SPARKGUARD "8" "" '), r.stdout[:200]


def test_bash_completion_completes_commands_and_options(tmp_path):
    pytest.importorskip("shtab", reason="shtab missing: pip install '.[man]'")
    r = run_sparkguard("completion", "bash")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "sparkguard.bash"
    script.write_text(r.stdout)

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        code = (f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
                f"COMP_LINE=\"{' '.join(words)}\"; COMP_POINT=${{#COMP_LINE}}; "
                "_shtab_sparkguard sparkguard; printf '%s\\n' \"${COMPREPLY[@]}\"")
        p = subprocess.run(["bash", "--norc", "-c", code], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return sorted(set(p.stdout.split()))

    assert {"install", "install-zram"} <= set(complete("sparkguard", "inst"))
    assert "--dry-run" in complete("sparkguard", "install", "--dr")
    assert {"bash", "zsh"} == set(complete("sparkguard", "completion", ""))
    z = run_sparkguard("completion", "zsh")
    assert z.returncode == 0 and z.stdout.startswith("#compdef sparkguard"), z.stdout[:100]


@pytest.mark.parametrize("command,lib", [("man", "argparse-manpage"), ("completion bash", "shtab")])
def test_without_the_library_the_error_says_what_to_install(command, lib):
    code = ("import sys; sys.modules.update(argparse_manpage=None, build_manpages=None, shtab=None); "
            f"from sparkguard.cli import main; sys.exit(main({command.split()!r}))")
    r = subprocess.run([sys.executable, "-c", code], env=sg_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert f"sparkguard: error: {lib} is not installed: pip install 'sparkguard[man]'" in r.stderr, r.stderr

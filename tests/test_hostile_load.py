"""Issue 32, class 1: work whose cost someone else controls never stops the poll loop.

A config whose YAML aliases multiply, a SIGHUP storm and a connection storm on the metrics port
are applied to a real ``sparkguard run`` while a real fake-vLLM tree fills real memory; each
crossing's SIGTERM is compared with a quiet crossing of the same daemon (docs/failure-modes.md,
"Work whose cost someone else controls").
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from conftest import line_below_now, run_sparkguard, sg_env, sparkguard_cmd
from guardrun import GuardProc
from test_guard_incidents import events, filling_engine, wait_incident

GiB = 1024**3


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A ~600-byte YAML document whose last anchor stands for ``width ** levels`` strings
    (9**9 = 387 million), given to a key that refuses a list (so an error message shows it)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\nguard:\n  grace: *l{levels - 1}\n"


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (2 * GiB, 2 * GiB))


def test_yaml_whose_aliases_multiply_is_refused_at_once_naming_the_file(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(alias_bomb())
    assert len(p.read_bytes()) < 700
    t = time.monotonic()
    r = subprocess.run(sparkguard_cmd("check-config", str(p)), env=sg_env(), capture_output=True, text=True,
                       timeout=60, preexec_fn=_limited)
    took = time.monotonic() - t
    assert r.returncode == 1, r.stderr[-2000:]
    assert str(p) in r.stderr and "aliases are expanded" in r.stderr, r.stderr[-2000:]
    assert took < 10, f"check-config took {took:.1f} s"


def test_recursive_alias_is_refused(tmp_path):
    p = tmp_path / "loop.yaml"
    p.write_text("targets:\n  match: &m [*m]\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1 and "recursive" in r.stderr, r.stderr


def test_anchors_that_stay_small_still_work(tmp_path):
    p = tmp_path / "anchors.yaml"
    p.write_text("guard:\n  grace: &g 9s\n  recovery_wait: *g\n"
                 "targets:\n  match: &pats ['vllm serve', 'sglang']\n  protect: *pats\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 0, r.stderr


def test_deeply_nested_value_is_refused_with_a_bounded_message(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("guard:\n  grace: " + "[" * 40 + "]" * 40 + "\n")
    r = run_sparkguard("check-config", str(p))
    assert r.returncode == 1 and "levels deep" in r.stderr, r.stderr
    assert len(r.stderr) < 1000

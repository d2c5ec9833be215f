"""bench/idle_variants.py patches the idle fast path's source by text: each variant must still
differ from the checkout where it says and import (a marker that drifted would fail the build)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_idle_variant_builds_and_imports(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "idle_variants.py"), "--no-nvml", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    assert {"now", "before", "fastfloor", "lean", "window", "noring", "full30", "fastfloor30"} <= set(names)
    mine = (ROOT / "sparkguard" / "guard" / "idle.py").read_text()
    mine_loop = (ROOT / "sparkguard" / "guard" / "loop.py").read_text()
    for name in names:
        r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import sparkguard.guard.loop, sparkguard.gpumem as g; assert not g.available()",
                            str(tmp_path / name)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (name, r.stderr)
        idle = (tmp_path / name / "sparkguard" / "guard" / "idle.py")
        loop = (tmp_path / name / "sparkguard" / "guard" / "loop.py")
        if name in ("fastfloor", "lean", "fastfloor30"):
            assert idle.read_text() != mine, name
        elif name in ("now", "window", "noring", "full30"):
            assert idle.read_text() == mine, name
        if name != "before":
            assert (loop.read_text() != mine_loop) == (name == "window"), name

#!/usr/bin/env python3
"""sparkguard's NVML figure per process against nvidia-smi's, on a machine with an NVIDIA GPU.

    python3 bench/nvml_check.py [--gib 2 0.5]

Starts one real CUDA process per ``--gib`` size (PyTorch ``torch.empty(N, dtype=uint8,
device="cuda")``, then it waits on stdin, so the caching allocator's cudaMalloc holds the bytes),
reads every process's GPU memory with sparkguard's reader (:func:`sparkguard.gpumem.read_once` on
the real nvidia-ml-py, the function the ``sg-gpumem`` thread calls) and with ``nvidia-smi
--query-compute-apps=pid,used_memory --format=csv``, and says whether they match (nvidia-smi
prints MiB: equal after rounding sparkguard's bytes to MiB).  Exit status 0 when all match.
Results: bench/results/nvml-h200.txt (docs/gpu-memory.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sparkguard import gpumem  # noqa: E402

MiB = 1 << 20

VICTIM = r"""
import sys, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def smi() -> dict[int, int]:
    """``{pid: MiB}`` from nvidia-smi's compute-apps query (printed as it came)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                         capture_output=True, text=True, timeout=30).stdout
    print(out)
    res = {}
    for line in out.splitlines()[1:]:
        pid, _, used = line.partition(",")
        if pid.strip().isdigit():
            res[int(pid)] = int(used.split()[0])
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", nargs="+", default=["2", "0.5"])
    args = ap.parse_args()
    import pynvml
    procs = []
    try:
        for g in args.gib:
            p = subprocess.Popen([sys.executable, "-c", VICTIM, g], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            assert p.stdout.readline().strip() == "ready", "the CUDA process did not start"
            procs.append((p, g))
            print(f"victim pid {p.pid}: torch.empty({g} GiB, uint8) on cuda")
        pynvml.nvmlInit()
        try:
            ours = gpumem.read_once(pynvml)
        finally:
            pynvml.nvmlShutdown()
        theirs = smi()
        ok = True
        for p, _ in procs:
            b = ours.get(p.pid)
            match = b is not None and round(b / MiB) == theirs.get(p.pid)
            ok &= match
            print(f"pid {p.pid}: sparkguard.gpumem.read_once {b} B = {(b or 0) / MiB:.1f} MiB; "
                  f"nvidia-smi {theirs.get(p.pid)} MiB; {'MATCH' if match else 'MISMATCH'}")
    finally:
        for p, _ in procs:
            p.kill()
            p.wait(30)
    print("RESULT:", "all figures match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

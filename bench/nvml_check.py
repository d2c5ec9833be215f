#!/usr/bin/env python3
"""sparkguard's NVML figure per process against nvidia-smi's, on a machine with an NVIDIA GPU.

    python3 bench/nvml_check.py [--gib 2 0.5] [--out FILE]

Starts one real CUDA process per ``--gib`` size (PyTorch: ``torch.empty(N, dtype=uint8,
device="cuda")`` then a sleep, so the caching allocator's cudaMalloc holds the bytes), reads every
process's GPU memory with sparkguard's own reader (:class:`sparkguard.gpumem.GpuMemory`, real
nvidia-ml-py) and with ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv``, and says
whether they match (nvidia-smi prints MiB: equal after rounding sparkguard's bytes to MiB).
Then :func:`sparkguard.proctree.find_targets` must put the process holding the most GPU memory
first, although every process has about the same RSS.  Exit status 0 when everything matched.
Results: bench/results/nvml-h200.txt (docs/gpu-memory.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sparkguard import config, gpumem, proctree  # noqa: E402

MiB = 1 << 20

VICTIM = r"""
import sys, time, torch
n = int(float(sys.argv[2]) * (1 << 30))
x = torch.empty(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def smi() -> dict[int, int]:
    """``{pid: MiB}`` from nvidia-smi's compute-apps query."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    print("nvidia-smi --query-compute-apps=pid,used_memory --format=csv:")
    print("  " + out.strip().replace("\n", "\n  "))
    res = {}
    for line in out.splitlines()[1:]:
        pid, _, used = line.partition(",")
        if pid.strip().isdigit():
            res[int(pid)] = int(used.strip().split()[0])
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, nargs="+", default=[2.0, 0.5])
    args = ap.parse_args()
    tag = f"sgnvml-{uuid.uuid4().hex[:8]}"
    procs = []
    ok = True
    try:
        for g in args.gib:
            p = subprocess.Popen([sys.executable, "-c", VICTIM, tag, str(g)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready", "victim did not start"
            procs.append((p, g))
            print(f"victim pid {p.pid}: torch.empty({g:g} GiB) on cuda")
        r = gpumem.GpuMemory(interval=0.5).start()
        assert r.first.wait(30), "no NVML reading"
        if r.error:
            print("sparkguard.gpumem:", r.error)
            return 1
        gpumem.install(r)
        time.sleep(1.0)                       # one more read after every victim is up
        ours = gpumem.reading()
        theirs = smi()
        print("sparkguard.gpumem (NVML nvmlDeviceGetComputeRunningProcesses, every device):")
        for p, g in procs:
            b = ours.get(p.pid)
            match = b is not None and round(b / MiB) == theirs.get(p.pid)
            ok &= match
            print(f"  pid {p.pid}: {b} bytes = {b / MiB if b is not None else float('nan'):.1f} MiB; "
                  f"nvidia-smi {theirs.get(p.pid)} MiB; allocated {g * 1024:.0f} MiB; "
                  f"{'MATCH' if match else 'MISMATCH'}")
        ts = proctree.find_targets(config.TargetsConfig(match=(tag,)))
        first = ts[0].root_pid if ts else None
        want = max(procs, key=lambda pg: pg[1])[0].pid
        print("proctree.find_targets order:", [(t.root_pid, t.mem_bytes, [row.get("gpu_bytes") for row in t.tree])
                                               for t in ts])
        print(f"engine chosen first: pid {first} (the most GPU memory: pid {want}): "
              f"{'OK' if first == want else 'WRONG'}")
        ok &= first == want
        r.stop()
    finally:
        for p, _ in procs:
            p.kill()
            p.wait(30)
    print("RESULT:", "all figures match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

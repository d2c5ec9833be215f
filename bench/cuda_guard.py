#!/usr/bin/env python3
"""A real CUDA process under signals and under sparkguard (run on a machine with an NVIDIA GPU).

    python3 bench/cuda_guard.py [--gpu-gib 40] [--pinned-gib 8] [--reps 3] [--json OUT]

The victim (``cuda_guard.py victim``) is a PyTorch process that holds ``--gpu-gib`` of GPU
memory (plain cudaMalloc through PyTorch's caching allocator) and ``--pinned-gib`` of
pinned host memory (cudaHostAlloc), and runs a Triton kernel over the GPU buffer in a loop.
With ``--handler`` it installs a SIGTERM handler that tears CUDA down itself (synchronize,
free, empty the cache) before it exits, as an inference engine does; with ``--block S``
it sits in a long CUDA call (``torch.cuda._sleep`` spinning the GPU for S seconds, then
``torch.cuda.synchronize()``), so a Python-level handler can run only when that call returns.

Measured per case, from the signal (CLOCK_MONOTONIC): time until the process has exited
(waitpid), time until the GPU memory is back (NVML ``nvmlDeviceGetMemoryInfo().used``, the
figure ``nvidia-smi`` shows, polled every 5 ms, back to the idle level + 512 MiB), and time
until MemAvailable is back (the pinned pages).  Cases: SIGTERM without handler, SIGTERM
with handler, SIGKILL, SIGTERM with handler while blocked in a long CUDA call; then
sparkguard itself (its daemon code from this checkout, ``guard.grace`` 3 s) guarding a
victim blocked in a long CUDA call: the victim's pinned allocation takes MemAvailable
under a line placed below the idle level, the guard SIGTERMs it, the handler cannot run,
and the guard must SIGKILL it after the grace period.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


# ----------------------------------------------------------------------------- victim


def victim(args) -> int:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, n, a, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(x_ptr + offs, x * a + 1.0, mask=m)

    state = {"term": None}
    bufs = {}

    def on_term(signum, frame):
        state["term"] = time.monotonic()
        torch.cuda.synchronize()
        bufs.clear()
        torch.cuda.empty_cache()
        os._exit(0)

    if args.handler:
        signal.signal(signal.SIGTERM, on_term)
    dev = torch.device("cuda")
    n = int(args.gpu_gib * GiB) // 4
    bufs["gpu"] = torch.ones(n, dtype=torch.float32, device=dev)
    work = bufs["gpu"][: 256 << 20]            # 1 GiB slice the kernel sweeps
    grid = (triton.cdiv(work.numel(), 1024),)
    axpy[grid](work, work.numel(), 0.5, BLOCK=1024)
    torch.cuda.synchronize()
    if args.block:
        torch.cuda._sleep(int(args.block * args.clock_hz))   # the GPU spins; the CPU returns at once
    bufs["pinned"] = torch.empty(int(args.pinned_gib * GiB), dtype=torch.uint8, pin_memory=True)
    bufs["pinned"].fill_(1)
    print("READY", os.getpid(), flush=True)
    if args.block:
        torch.cuda.synchronize()               # blocked here in a CUDA call for ~block seconds
        print("UNBLOCKED", flush=True)
    while True:
        for _ in range(50):
            axpy[grid](work, work.numel(), 0.5, BLOCK=1024)
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- measuring


def mem_available() -> int:
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Gpu:
    def __init__(self):
        import pynvml
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.h).used

    def name(self) -> str:
        n = self.nvml.nvmlDeviceGetName(self.h)
        return n.decode() if isinstance(n, bytes) else n


def start_victim(args, *extra: str, tag: str = "") -> subprocess.Popen:
    argv = [sys.executable, os.path.abspath(__file__), "victim", "--gpu-gib", str(args.gpu_gib),
            "--pinned-gib", str(args.pinned_gib), "--clock-hz", str(args.clock_hz), *extra]
    if tag:
        argv += ["--tag", tag]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)


def wait_ready(p: subprocess.Popen, timeout: float = 180) -> float:
    import select
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([p.stdout], [], [], 1)
        if r:
            line = p.stdout.readline()
            if line.startswith("READY"):
                return time.monotonic()
            if not line:
                break
    raise RuntimeError(f"victim not ready (rc {p.poll()})")


def watch_release(p: subprocess.Popen, gpu: Gpu, t0: float, gpu_idle: int, avail_idle: int,
                  timeout: float = 120) -> dict:
    """After a signal at t0: exit time, GPU memory back, MemAvailable back (seconds from t0)."""
    out = {"exit_s": None, "gpu_back_s": None, "host_back_s": None}
    end = t0 + timeout
    while time.monotonic() < end and None in out.values():
        now = time.monotonic()
        if out["exit_s"] is None and p.poll() is not None:
            out["exit_s"] = now - t0
        if out["gpu_back_s"] is None and gpu.used() <= gpu_idle + 512 * 2**20:
            out["gpu_back_s"] = now - t0
        if out["host_back_s"] is None and mem_available() >= avail_idle - GiB:
            out["host_back_s"] = now - t0
        time.sleep(0.005)
    return out


def case(args, gpu, name: str, sig: int, extra: list[str], gpu_idle: int, avail_idle: int,
         delay: float = 1.0) -> dict:
    p = start_victim(args, *extra)
    try:
        wait_ready(p)
        time.sleep(delay)                      # inside the kernel loop (or the blocking call)
        held = gpu.used() - gpu_idle
        t0 = time.monotonic()
        p.send_signal(sig)
        r = watch_release(p, gpu, t0, gpu_idle, avail_idle)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    r.update({"case": name, "gpu_held_gib": round(held / GiB, 2)})
    print(json.dumps(r), flush=True)
    return r


def guarded(args, gpu, gpu_idle: int, avail_idle: int) -> dict:
    """sparkguard's daemon against a victim blocked in a long CUDA call."""
    work = tempfile.mkdtemp(prefix="sg-cuda-")
    tag = "sgcuda" + uuid.uuid4().hex[:8]
    line = avail_idle - int(args.pinned_gib * GiB) // 2
    conf = os.path.join(work, "sg.yaml")
    with open(conf, "w") as f:
        json.dump({"guard": {"term_below": line, "grace": f"{args.grace}s"},
                   "targets": {"match": [tag]}, "metrics": {"listen": "off"},
                   "incidents": {"dir": os.path.join(work, "inc"), "journal": "off"}}, f)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    log = open(os.path.join(work, "guard.log"), "w+")
    g = subprocess.Popen([sys.executable, "-c", "import sys, argparse; from sparkguard import daemon; "
                          "sys.exit(daemon.cmd_run(argparse.Namespace(config=sys.argv[1], dry_run=False, "
                          "log_level='info', meminfo='/proc/meminfo')))", conf], env=env, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(3)
    t_start = time.monotonic()
    p = start_victim(args, "--handler", "--block", str(args.block), tag=tag)
    try:
        # No READY wait: the handler runs right after the pinned allocation returns and then
        # blocks in torch.cuda.synchronize() behind the spinning kernel, so READY may never come.
        p.wait(args.grace + args.block + 120)
        t_exit = time.monotonic()
        r = watch_release(p, gpu, t_exit, gpu_idle, avail_idle)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        g.send_signal(signal.SIGTERM)
        g.wait(10)
    log.seek(0)
    text = log.read()
    events = [ln for ln in text.splitlines() if "incident" in ln or "SIG" in ln]
    r = {"case": f"sparkguard, victim blocked {args.block:g}s in CUDA, grace {args.grace:g}s",
         "victim_lifetime_s": round(t_exit - t_start, 3), "victim_rc": p.returncode,
         "gpu_back_after_exit_s": r["gpu_back_s"], "host_back_after_exit_s": r["host_back_s"],
         "escalated": any("sigkill" in ln.lower() for ln in events), "guard_log": events[-10:]}
    print(json.dumps(r, indent=1), flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    v = sub.add_parser("victim")
    for a in (ap, v):
        a.add_argument("--gpu-gib", type=float, default=40)
        a.add_argument("--pinned-gib", type=float, default=8)
        a.add_argument("--clock-hz", type=float, default=1.98e9, help="GPU clock for torch.cuda._sleep cycles")
    v.add_argument("--handler", action="store_true")
    v.add_argument("--block", type=float, default=0)
    v.add_argument("--tag", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block", type=float, default=12.0, help="seconds the blocked victim spends in one CUDA call")
    ap.add_argument("--grace", type=float, default=3.0, help="sparkguard grace for the guarded case")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cmd == "victim":
        return victim(args)
    gpu = Gpu()
    time.sleep(0.5)
    gpu_idle, avail_idle = gpu.used(), mem_available()
    import torch
    info = {"gpu": gpu.name(), "torch": torch.__version__, "gpu_idle_used_mib": gpu_idle >> 20,
            "mem_available_gib": round(avail_idle / GiB, 1)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(info), flush=True)
    rows = []
    for _ in range(args.reps):
        rows.append(case(args, gpu, "SIGTERM, no handler", signal.SIGTERM, [], gpu_idle, avail_idle))
        rows.append(case(args, gpu, "SIGTERM, handler tears CUDA down", signal.SIGTERM, ["--handler"], gpu_idle,
                         avail_idle))
        rows.append(case(args, gpu, "SIGKILL", signal.SIGKILL, [], gpu_idle, avail_idle))
    rows.append(case(args, gpu, f"SIGTERM, handler, blocked {args.block:g}s in a CUDA call", signal.SIGTERM,
                     ["--handler", "--block", str(args.block)], gpu_idle, avail_idle, delay=0.5))
    guard = guarded(args, gpu, gpu_idle, avail_idle)
    summary = {}
    for r in rows:
        s = summary.setdefault(r["case"], {"exit_s": [], "gpu_back_s": [], "host_back_s": []})
        for k in s:
            if r[k] is not None:
                s[k].append(round(r[k], 3))
    print("\n| case | SIGTERM/SIGKILL -> exit s | -> GPU memory back s | -> MemAvailable back s |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        def fmt(v):
            return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "n/a"
        print(f"| {name} | {fmt(s['exit_s'])} | {fmt(s['gpu_back_s'])} | {fmt(s['host_back_s'])} |")
    print(f"\nguarded: {json.dumps(guard)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "guarded": guard, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

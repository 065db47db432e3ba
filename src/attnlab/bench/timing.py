"""Timing and the machine: medians of repeated runs, the rates rooflines are measured against.

Every benchmark of attnlab takes its figures through these: median wall time after a
warm-up (a CUDA device synchronised around each call), the machine's description, and
the matrix-multiply rate and memory bandwidth measured in the same run.
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch

from ..runtime.environment import environment


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()



def median_time(fn: Callable[[], object], reps: int = 5, warmup: int = 1, device="cpu") -> float:
    """Median wall time of fn() in seconds (synchronising a CUDA device around each call)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)



def machine_info(device="cpu") -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env = environment()
    info = {"cpu": cpu, "threads": env["threads"], "torch": env["torch"], "python": env["python"],
            "device": str(device)}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info



def measure_rates(reps: int = 5, n: int = 2048, mbytes: int = 512, device="cpu") -> dict:
    """float32 matrix-multiply rate (FLOP/s, an n x n GEMM) and read bandwidth (bytes/s, a big sum)."""
    if torch.device(device).type == "cuda":
        n, mbytes = 8192, 2048
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    t = median_time(lambda: a @ b, reps, device=device)
    big = torch.randn(mbytes * 2 ** 20 // 4, device=device)
    t_bw = median_time(lambda: big.sum(), reps, device=device)
    return {"flops_per_s": 2 * n ** 3 / t, "bytes_per_s": big.numel() * 4 / t_bw}

"""What a result was computed with: the Python, the libraries whose arithmetic decides the figures, torch's
threads, and the processor (and GPU) it ran on. A run's report keeps it beside the figures, so that two runs of the
same command and seed that differ can be told apart by what they ran on (a library's version can change a model's
numerics, and the text a model writes for itself follows them; a time-budgeted heal does as much work as the
processor allows in its minutes, and at 12.5% its result follows its steps closely: docs/decisions.md).
"""
from __future__ import annotations

import math
import os
import platform
from importlib import metadata

import torch

LIBRARIES = ("numpy", "transformers", "tokenizers", "safetensors", "gguf")  # beside torch (its build is its version)


def processor() -> str:
    """The CPU's model name as the system states it (Linux: /proc/cpuinfo's "model name"; elsewhere
    platform.processor(), or the machine's architecture where that is empty)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# /proc/cpuinfo flags of a CPU that multiplies bfloat16 natively (AVX-512 BF16, AMX): there torch's bf16 matrix
# products run at about twice float32's rate (measured on a 2-core AMD EPYC, torch 2.13: a 1024 x 576 by 576 x 1536
# product 4.3 ms against 9.5); without them bf16 is converted in software and ran slower than float32
# (docs/performance.md, "bf16 decode")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 natively: one of BF16_FLAGS among the "flags" of `cpuinfo` (the text of
    /proc/cpuinfo; read from there when None, and False where it cannot be read: not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return any(flag in value.split() for flag in BF16_FLAGS)
    return False


def environment() -> dict:
    """{"python", "torch", "threads", "cpu" (processor()), "cores" (os.cpu_count()), "cpu_bf16" (cpu_bf16()), "gpu"
    (CUDA device 0's name, None without one), and each of LIBRARIES installed: its version (None when it is not)}."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": processor(), "cores": os.cpu_count(), "cpu_bf16": cpu_bf16(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def env_number(variable: str, default: float, low: float, high: float, rule: str) -> float:
    """`default`, or the finite number the environment variable holds where set; ValueError naming the variable, the
    rule ("of at least 1") and the value unless low <= it <= high."""
    value = os.environ.get(variable)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not low <= number <= high or math.isinf(number):
        raise ValueError(f"{variable} must be a number {rule}, got {value!r}")
    return number

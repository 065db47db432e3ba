"""What a result was computed with: the Python, the libraries whose arithmetic decides the figures, torch's
threads, and the processor (and GPU) it ran on. A run's report keeps it beside the figures, so that two runs of the
same command and seed that differ can be told apart by what they ran on (a library's version can change a model's
numerics, and the text a model writes for itself follows them; a time-budgeted heal does as much work as the
processor allows in its minutes, and at 12.5% its result follows its steps closely: docs/real-models.md).
"""
from __future__ import annotations

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


def environment() -> dict:
    """{"python", "torch", "threads", "cpu" (processor()), "cores" (os.cpu_count()), "gpu" (CUDA device 0's name, None
    without one), and each of LIBRARIES installed: its version (None when it is not)}."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": processor(), "cores": os.cpu_count(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out

"""What a result was computed with: the Python, the libraries whose arithmetic decides the figures, and torch's
threads. A run's report keeps it beside the figures, so that two runs of the same command and seed that differ can be
told apart by what they ran on (a library's version can change a model's numerics, and the text a model writes for
itself follows them).
"""
from __future__ import annotations

import platform
from importlib import metadata

import torch

LIBRARIES = ("numpy", "transformers", "tokenizers", "safetensors", "gguf")  # beside torch (its build is its version)


def environment() -> dict:
    """{"python", "torch", "threads", and each of LIBRARIES installed: its version (None when it is not)}."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out

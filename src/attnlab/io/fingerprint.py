"""A fingerprint of a set of weights: which model a checkpoint belongs to, without storing the model.

`fingerprint(named tensors)` hashes every tensor's name, dtype, shape and a strided sample of at most SAMPLE of its
values (all of a small tensor's), so two models of one shape but other weights (another run, another seed) get
different fingerprints, quickly even for billions of parameters.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

SAMPLE = 1 << 16


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 hex digest of the tensors' names, dtypes, shapes and sampled values."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        sample = flat[::step].to("cpu", torch.float64).contiguous()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()

"""Closed-form refits of an MLA's up-projections against its quantised latent (issue `eighth`, part 4).

A cached latent c is read back as c^ = Q(c), the storage's codes (modules/storage.py round_trip). The keys and values
the module reads are W_UK c^ and W_UV c^; what they were meant to be is W_UK c and W_UV c. Over the calibration
tokens (C, C^: N x r, the latent and its read-back, float64), the up-projection that makes the read-back's keys and
values closest to the intended ones in least squares is

    W_U' = argmin_W |C^ W^T - C W_U^T|^2 = (C W_U^T)^T C^ (C^T^ C^ + eps I)^-1,

one solve per module for W_UK and W_UV together (eps = 1e-9 of the mean diagonal keeps a component the codes never
moved well posed). Where the storage is plain (C^ = C) it returns W_U itself. The rows are the module's own cached
rows, [c, k_R] with the rope key turned at the calibration positions, so that a storage whose rope key is coded
per channel over groups of tokens (+c4) is applied as the cache applies it. Core: torch only.
"""
from __future__ import annotations

import torch

from ..modules.storage import round_trip

F64 = torch.float64
RIDGE = 1e-9


def latent_pairs(mla, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, C^) (N, r) float64: the latent of the calibration rows `inputs` (N, context_dim, one sequence in order) and
    what the module's storage reads back for it (C itself for a plain storage)."""
    with torch.no_grad():
        x = inputs.to(mla.W_DKV.weight.dtype)[None]  # (1, N, dim)
        rows = mla.compress(x, torch.arange(x.shape[1], device=x.device))  # (1, N, r + p)
        stored = rows if mla.kv_dtype is None else round_trip(rows, mla.kv_dtype, mla._kv_parts())
    r = mla.latent_dim
    return rows[0, :, :r].to(F64), stored[0, :, :r].to(F64)


def refit_up(mla, inputs: torch.Tensor, which: str = "kv") -> dict:
    """Refit W_UK and W_UV ("kv"), or W_UV alone ("v"), in place (module docstring); returns the keys' and values' mean squared error per token on
    the calibration rows before and after. ValueError for a latent norm (the read-back then passes through it) or a
    GQA tiling (the fit would break the tiling)."""
    if mla.kv_norm is not None or mla.kv_tiling is not None:
        raise ValueError("refit_up fits the up-projections to the raw latent; a latent norm (a GGUF's) or a GQA "
                         "tiling is not refitted")
    if which not in ("kv", "v"):
        raise ValueError(f"which must be 'kv' (keys and values) or 'v' (values alone), got {which!r}")
    C, Ch = latent_pairs(mla, inputs)
    ups = [mla.W_UK, mla.W_UV] if which == "kv" else [mla.W_UV]
    W = torch.cat([up.weight.detach() for up in ups]).to(F64)  # (out, r)
    target = C @ W.T  # (N, out): the keys and values the latent is meant to give
    gram = Ch.T @ Ch
    ridge = RIDGE * float(gram.diagonal().mean()) * torch.eye(gram.shape[0], dtype=F64)
    new = torch.linalg.solve(gram + ridge, Ch.T @ target).T  # (out, r)
    before = float(((Ch @ W.T - target) ** 2).sum(1).mean())
    after = float(((Ch @ new.T - target) ** 2).sum(1).mean())
    if after > before:  # the ridge can only cost where nothing was wrong: keep the original then
        return {"before": before, "after": before, "refitted": False}
    with torch.no_grad():
        start = 0
        for up in ups:
            up.weight.copy_(new[start:start + up.weight.shape[0]].to(up.weight.dtype))
            start += up.weight.shape[0]
    return {"before": before, "after": after, "refitted": True}

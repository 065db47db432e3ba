"""Pick the conversion from the module's family and the target family (the CLI's entry point)."""
from __future__ import annotations

import torch
from torch import nn

from ..modules.gqa import GroupedQueryAttention
from ..modules.mla import MultiHeadLatentAttention
from .base import _expect
from .exact import absorb, gqa_to_mha, gqa_to_mla, mla_to_mha
from .lossy import mha_to_gqa, mha_to_mla

TARGETS = ("mha", "gqa", "mla", "absorbed")



def convert(module: nn.Module, to: str, *, num_kv_heads: int | None = None, method: str | None = None,
            latent_dim: int | None = None, energy: float | None = None, joint: bool = True,
            calibration: torch.Tensor | None = None):
    """Pick the conversion from the module's family and the target family (the CLI's entry point).

    GQA/MHA -> "mha" (exact), "gqa" (num_kv_heads; method mean|fit), "mla" (exact without
    latent_dim/energy, else truncated SVD); MLA -> "mha" (exact), "absorbed" (exact).
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target {to!r}; choose one of {', '.join(TARGETS)}")
    if isinstance(module, MultiHeadLatentAttention):
        if to == "mha":
            return mla_to_mha(module)
        if to == "absorbed":
            return absorb(module)
        raise ValueError(f"an MLA converts to 'mha' or 'absorbed', not {to!r}")
    _expect(module, GroupedQueryAttention, "convert")
    if to == "mha":
        return gqa_to_mha(module)
    if to == "gqa":
        if num_kv_heads is None:
            raise ValueError("converting to 'gqa' needs num_kv_heads (--kv-heads)")
        return mha_to_gqa(module, num_kv_heads, method=method or "mean", calibration=calibration)
    if to == "mla":
        if latent_dim is None and energy is None and calibration is None and joint:
            return gqa_to_mla(module)
        return mha_to_mla(module, latent_dim=latent_dim, energy=energy, joint=joint, calibration=calibration)
    raise ValueError("'absorbed' applies to an MLA; convert to 'mla' first")

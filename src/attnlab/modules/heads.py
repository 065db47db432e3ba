"""Which key/value head each query head reads, and the tilings that follow (`kv_head_of`, `tile_heads`, `gqa_block`).

H query heads, G KV heads, C = H // G, d head size; head h owns rows [h*d, (h+1)*d) of a stacked projection.
"strided" (the study, Part 7): query head h reads KV head h mod G, so the tiled matrix is C copies of the whole
(G*d, D) block stacked; "blocked" (Llama, transformers): h reads KV head h // C, each KV head's d rows repeated C times.
"""
from __future__ import annotations

import torch

GROUPINGS = ("strided", "blocked")



def check_grouping(grouping: str) -> str:
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    return grouping



def kv_head_of(num_heads: int, num_kv_heads: int, grouping: str) -> torch.Tensor:
    """Index of the KV head that each query head reads, shape (H,)."""
    check_grouping(grouping)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    h = torch.arange(num_heads)
    if grouping == "strided":
        return h % num_kv_heads
    return h // (num_heads // num_kv_heads)



def tile_heads(weight: torch.Tensor, num_heads: int, num_kv_heads: int, grouping: str = "strided"):
    """Expand a (G*d, ...) KV projection (or bias) to (H*d, ...) rows, query head by query head.

    With grouping="strided" this is the study's tilde-W of Part 6: C copies of
    the whole matrix stacked along axis 0.
    """
    per_head = _per_head(weight, num_kv_heads, "num_kv_heads")  # (G, d, ...)
    idx = kv_head_of(num_heads, num_kv_heads, grouping)
    return per_head[idx.to(weight.device)].flatten(0, 1)  # (H*d, ...)



def _per_head(weight: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """(heads * d, ...) rows -> (heads, d, ...)."""
    if weight.shape[0] % heads:
        raise ValueError(f"weight rows ({weight.shape[0]}) must be divisible by {name} ({heads})")
    return weight.reshape(heads, weight.shape[0] // heads, *weight.shape[1:])



def gqa_block(weight: torch.Tensor, num_heads: int, num_kv_heads: int, *,
              grouping: str = "strided", rtol: float = 1e-10) -> torch.Tensor | None:
    """Part 11 in general: if the (H*d, D) matrix is a GQA tiling, return its (G*d, D) block.

    Returns None when some query head's rows differ from those of the first head
    in its group by more than rtol relative to the matrix's largest entry.
    """
    idx = kv_head_of(num_heads, num_kv_heads, grouping)
    per_head = _per_head(weight, num_heads, "num_heads")  # (H, d, ...)
    # the first query head of each group: g itself (strided) or g*C (blocked)
    step = 1 if grouping == "strided" else num_heads // num_kv_heads
    block = per_head[torch.arange(num_kv_heads) * step]  # (G, d, ...)
    scale = weight.abs().max().clamp_min(torch.finfo(weight.dtype).tiny)
    if (per_head - block[idx]).abs().max() > rtol * scale:
        return None
    return block.flatten(0, 1)  # (G*d, ...)

"""Rotary position embeddings (RoPE): `RotaryEmbedding`.

A vector of size `dim` is split into dim/2 pairs; pair i at position p is rotated by p * base^(-2i/dim), the angles
computed in float64 and cast to the input's dtype. Layouts: "half" (Llama, GPT-NeoX, transformers' rotate_half): pair
i is (x_i, x_{i+dim/2}); "interleaved" (RoFormer, DeepSeek's checkpoints): pair i is (x_{2i}, x_{2i+1}).
"""
from __future__ import annotations

import torch
from torch import nn

from . import checks


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0, *, interleaved: bool = False,
                 inv_freq: torch.Tensor | None = None, scaling: float = 1.0):
        super().__init__()
        checks.positive_int("rope dim", dim)
        if dim % 2:
            raise ValueError(f"rope dim must be even, got {dim}")
        if base <= 0:
            raise ValueError(f"rope base must be positive, got {base}")
        self.dim, self.base, self.interleaved, self.scaling = dim, float(base), bool(interleaved), float(scaling)
        if inv_freq is None:
            inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        elif inv_freq.shape != (dim // 2,):
            raise ValueError(f"inv_freq must have shape ({dim // 2},), got {tuple(inv_freq.shape)}")
        # persistent: converted models carry their own frequencies (e.g. one per kept pair)
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float64))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"

    def angles(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of shape positions.shape + (dim/2,)."""
        theta = positions.to(torch.float64)[..., None] * self.inv_freq.to(positions.device)
        return (theta.cos() * self.scaling).to(dtype), (theta.sin() * self.scaling).to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x (B, heads, L, dim) at positions (L,) or (B, L)."""
        cos, sin = self.angles(positions, x.dtype)  # (L, dim/2) or (B, L, dim/2)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, dim/2)
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))  # (..., dim/2, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (..., dim)
        a, b = x.chunk(2, dim=-1)  # (..., dim/2) each
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., dim)


def default_positions(start: int, length: int, device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device)

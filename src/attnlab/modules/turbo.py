"""TurboQuant's codes (Zandieh et al., arXiv 2504.19874), without its 1-bit residual sketch: "tq<b>".

Each head vector x of g values (g a power of two) is rotated, y = H (s * x), s random signs drawn once per g from
SIGN_SEED; its norm is stored in float16; each coordinate of y sqrt(g) / |x| (near N(0, 1)) takes the nearest of the
2^b Lloyd-Max levels of N(0, 1) (`levels`). Read back x = s * H (level * |x| / sqrt(g)): b bits a value, 16 a head.
"""
from __future__ import annotations

import functools
import math
from statistics import NormalDist

import torch

from .rotation import hadamard_transform

SIGN_SEED = 20250427  # the signs of the randomized Hadamard transform: one fixed draw per head size
LLOYD_STEPS = 300  # Lloyd's iterations from the normal's quantiles: the levels move by < 1e-12 after about 150


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@functools.cache
def levels(bits: int) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending (float64; Lloyd's algorithm on the exact density)."""
    n = 1 << bits
    c = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    for _ in range(LLOYD_STEPS):
        edges = [-math.inf, *((a + b) / 2 for a, b in zip(c, c[1:])), math.inf]
        c = [(_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a)) for a, b in zip(edges, edges[1:])]
    return tuple(c)


def distortion(bits: int) -> float:
    """E[(X - Q(X))^2] for X ~ N(0, 1) and its Lloyd-Max quantiser: 1 - sum p_i c_i^2 (centroids: E[X Q] = E[Q^2])."""
    c = levels(bits)
    edges = [-math.inf, *((a + b) / 2 for a, b in zip(c, c[1:])), math.inf]
    return 1 - sum((_cdf(b) - _cdf(a)) * v * v for v, a, b in zip(c, edges, edges[1:]))


@functools.cache
def _signs(g: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SIGN_SEED + g)
    return (torch.randint(0, 2, (g,), generator=gen) * 2 - 1).to(torch.float64)


def encode(xg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head vectors xg (..., n, g) float32 -> level indices (..., n, g) uint8 and norms (..., n, 1) float16."""
    g = xg.shape[-1]
    norm = torch.linalg.vector_norm(xg, dim=-1, keepdim=True).to(torch.float16)  # (..., n, 1), as stored
    y = hadamard_transform(xg * _signs(g).to(xg), g)  # (..., n, g)
    kept = norm.float()
    u = y * torch.where(kept > 0, math.sqrt(g) / kept, torch.zeros_like(kept))
    lv = torch.tensor(levels(bits), dtype=xg.dtype, device=xg.device)
    codes = torch.searchsorted((lv[1:] + lv[:-1]) / 2, u.contiguous())  # the nearest level
    return codes.to(torch.uint8), norm


def decode(codes: torch.Tensor, norms: torch.Tensor, bits: int, work: torch.dtype) -> torch.Tensor:
    """Level indices (..., n, g) and norms (..., n, 1) -> head vectors (..., n, g) in `work`."""
    g = codes.shape[-1]
    lv = torch.tensor(levels(bits), dtype=work, device=codes.device)
    y = lv[codes.long()] * (norms.to(work) / math.sqrt(g))
    return hadamard_transform(y, g) * _signs(g).to(device=codes.device, dtype=work)

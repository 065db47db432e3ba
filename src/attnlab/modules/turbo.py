"""TurboQuant's codes (Zandieh et al., arXiv 2504.19874): "tq<b>", and "tqp<b>" with its 1-bit residual sketch (QJL).

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
SKETCH_SEED = 20250428  # the residual sketch's Gaussian matrix S (g x g): one fixed draw per head size
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


# TurboQuant_prod ("tqp<b>"): the (b-1)-bit codes above, then the residual r = x - read-back sketched as the signs of
# S r (S: g x g, N(0, 1) entries), with |r| in float16; read back as read-back + |r| sqrt(pi/2) / g S^T sign(S r), an
# unbiased inner product with any query over S's draw (the paper's Theorem 2; variance at most pi / (2g) |r|^2 |q|^2).
# A code holds the sign in its top bit: b bits a value and two float16 numbers a head.
@functools.cache
def _sketch(g: int) -> torch.Tensor:
    return torch.randn(g, g, generator=torch.Generator().manual_seed(SKETCH_SEED + g), dtype=torch.float64)


def encode_sketched(xg: torch.Tensor, bits: int, s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Head vectors xg (..., n, g) -> codes (..., n, g) uint8 (the sign in bit bits - 1) and meta (..., n, 2) float16
    (the norm, |r|); s: another S (tests), else the fixed draw for g."""
    g = xg.shape[-1]
    codes, norm = encode(xg, bits - 1)
    r = xg - decode(codes, norm, bits - 1, xg.dtype)
    s = (_sketch(g) if s is None else s).to(device=xg.device, dtype=xg.dtype)
    signs = (r @ s.T >= 0).to(torch.uint8)
    residual = torch.linalg.vector_norm(r, dim=-1, keepdim=True).to(torch.float16)
    return codes | (signs << (bits - 1)), torch.cat([norm, residual], -1)


def decode_sketched(codes: torch.Tensor, meta: torch.Tensor, bits: int, work: torch.dtype,
                    s: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of encode_sketched: codes (..., n, g) and meta (..., n, 2) -> head vectors (..., n, g) in `work`."""
    g = codes.shape[-1]
    x = decode(codes & ((1 << (bits - 1)) - 1), meta[..., :1], bits - 1, work)
    sign = (codes >> (bits - 1)).to(work) * 2 - 1
    s = (_sketch(g) if s is None else s).to(device=codes.device, dtype=work)
    return x + (sign @ s) * (meta[..., 1:].to(work) * (math.sqrt(math.pi / 2) / g))

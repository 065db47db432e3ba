"""Linear algebra on projection matrices, shared by the conversions and the study (usaaio).

Plain weight matrices only (torch tensors, or numpy arrays where noted), no modules; head layouts and tilings
(strided, blocked) are modules/heads.py's. Notation: H query heads, G key/value heads, C = H // G query heads per KV
head, d head size, D model width, r latent size.
"""
from __future__ import annotations


import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..modules.heads import gqa_block, tile_heads


def matrix_rank(weight, rtol: float | None = None) -> int:
    """Numerical rank (singular values above rtol * largest), numpy or torch input."""
    t = torch.as_tensor(np.asarray(weight)) if isinstance(weight, np.ndarray) else weight
    return int(torch.linalg.matrix_rank(t.detach().to(torch.float64), rtol=rtol))


def tiled_rank(weight, copies: int) -> tuple[int, int]:
    """Part 6: (rank of W, rank of C stacked copies of W). They are always equal."""
    if copies < 1:
        raise ValueError(f"copies must be a positive integer, got {copies}")
    t = torch.as_tensor(np.asarray(weight)) if isinstance(weight, np.ndarray) else weight
    return matrix_rank(t), matrix_rank(torch.cat([t] * copies, dim=0))


def is_gqa_representable(weight, num_heads: int, num_kv_heads: int, *,
                         grouping: str = "strided", rtol: float = 1e-10) -> bool:
    """Part 11: can this K or V projection be written as G KV heads shared by H query heads?"""
    t = torch.as_tensor(np.asarray(weight)) if isinstance(weight, np.ndarray) else weight
    return gqa_block(t, num_heads, num_kv_heads, grouping=grouping, rtol=rtol) is not None


def low_rank_factors(weight: torch.Tensor, rank: int):
    """Best rank-`rank` factorisation W ~ up @ down by truncated SVD (Eckart-Young).

    Returns (up, down, singular_values) with up = U_r (orthonormal columns),
    down = diag(S_r) V_r^T: the split of Part 9. singular_values are all of them.
    """
    m, n = weight.shape
    if not 1 <= rank <= min(m, n):
        raise ValueError(f"rank ({rank}) must be between 1 and min{weight.shape} = {min(m, n)}")
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    return u[:, :rank], s[:rank, None] * vh[:rank], s


def rank_for_energy(singular_values: torch.Tensor, energy: float) -> int:
    """Smallest rank whose squared singular values keep at least `energy` of the total."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    power = singular_values.to(torch.float64) ** 2
    kept = torch.cumsum(power, 0) / power.sum()
    # tolerate rounding in the last place so that energy=1.0 gives the numerical rank
    return min(int((kept < energy - 1e-12).sum()) + 1, len(singular_values))


def energy_kept(singular_values: torch.Tensor, rank: int) -> float:
    power = singular_values.to(torch.float64) ** 2
    return float(power[:rank].sum() / power.sum())


def fold_query(w_q: torch.Tensor, w_uk: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Part 12: stack W_UK_h^T W_Q_h over heads, shape (H*r, D_1).

    w_q is (H*d, D_1), w_uk is (H*d, r). Query head h then produces its latent
    query directly from x: q_hat_h = (W_UK_h^T W_Q_h) x.
    """
    d = w_q.shape[0] // num_heads
    r = w_uk.shape[1]
    per_head = w_uk.reshape(num_heads, d, r).transpose(1, 2) @ w_q.reshape(num_heads, d, -1)  # (H, r, D_1)
    return per_head.reshape(num_heads * r, -1)  # (H*r, D_1)


def fold_output(w_o: torch.Tensor, w_uv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Part 12: the blocks W_O_h W_UV_h side by side, shape (D_1, H*r)."""
    dim = w_o.shape[0]
    dv = w_o.shape[1] // num_heads
    r = w_uv.shape[1]
    per_head = w_o.reshape(dim, num_heads, dv).transpose(0, 1) @ w_uv.reshape(num_heads, dv, r)  # (H, D_1, r)
    return per_head.transpose(0, 1).reshape(dim, num_heads * r)  # (D_1, H*r)


FACTOR_METHODS = ("select", "block-svd", "tiled-svd")


def factor_tiled(block: torch.Tensor,  # the (G*d, D) projection
                 num_heads: int, num_kv_heads: int, grouping: str = "strided",
                 method: str = "block-svd", rtol: float | None = None):
    """Part 9 for a GQA projection: tile(block) = up @ down, r = rank(block) <= G*d. Returns (up (H*d, r), down (r, D)).

    "select": down = block, up = the 0/1 tiling (r = G*d, no arithmetic). "block-svd": block = U S V^T, up = tile(U) /
    sqrt(C), down = sqrt(C) S V^T: the tiled matrix's SVD (values sqrt(C) S) for the cost of a G*d x D one.
    "tiled-svd" forms the tiled (H*d, D) matrix and takes its SVD (the study's route, Part 10, kept for comparison).
    """
    if method not in FACTOR_METHODS:
        raise ValueError(f"method must be one of {FACTOR_METHODS}, got {method!r}")
    C = num_heads // num_kv_heads
    if method == "select":
        eye = torch.eye(block.shape[0], dtype=block.dtype, device=block.device)
        return tile_heads(eye, num_heads, num_kv_heads, grouping), block.clone()
    if method == "tiled-svd":
        return svd_factors(tile_heads(block, num_heads, num_kv_heads, grouping), rtol)
    up, down = svd_factors(block, rtol)
    return tile_heads(up, num_heads, num_kv_heads, grouping) / C ** 0.5, (C ** 0.5) * down


def svd_factors(weight: torch.Tensor, rtol: float | None = None):
    """W = up @ down through its numerical rank r: up = U_r, down = S_r V_r^T (Part 9's split).

    Singular values below rtol * the largest count as zero; rtol defaults to
    max(shape) * machine epsilon of the dtype (numpy's matrix_rank rule).
    """
    if rtol is None:
        rtol = max(weight.shape) * torch.finfo(weight.dtype).eps
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    r = int((s > s[0] * rtol).sum()) if s.numel() and s[0] > 0 else 0
    return u[:, :r], s[:r, None] * vh[:r]


# input_covariance's memo: a calibration tensor (held weakly: its entry goes with it) -> (version, cov). A planner
# converts every layer once per candidate from the same calibration inputs, so each tensor's product is made once
_COVARIANCES = WeakIdKeyDictionary()


def input_covariance(calibration: torch.Tensor) -> torch.Tensor:
    """(D, D) float64 second moment Y^T Y / N of calibration inputs (..., D), the samples Y as rows.

    Memoised per tensor (_COVARIANCES); a tensor changed in place since (its views share the version counter) is
    computed again. The same float64 product either way."""
    version = calibration._version
    hit = _COVARIANCES.get(calibration)
    if hit is not None and hit[0] == version:
        return hit[1]
    y = calibration.detach().reshape(-1, calibration.shape[-1]).to(torch.float64)
    cov = y.T @ y / y.shape[0]
    if not calibration.requires_grad:  # a tensor of a graph is not kept past its use
        _COVARIANCES[calibration] = (version, cov)
    return cov


def whitening(calibration: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """Lower-triangular L with L L^T = covariance of the calibration inputs (+ a small ridge).

    calibration: (..., D) samples of what a projection reads. For a projection W,
    the mean squared output over the samples is ||W L||_F^2 / N-normalised, so a
    truncated SVD of W L is the best low-rank W for those inputs.
    """
    cov = input_covariance(calibration)
    lam = ridge * float(torch.diagonal(cov).mean().clamp_min(1e-30))
    return torch.linalg.cholesky(cov + lam * torch.eye(cov.shape[0], dtype=cov.dtype))

"""The study's own names (USA-NA-AIO 2025 Round 2, Problem 2), as thin wrappers over attnlab.

`from attnlab.study.usaaio import *` gives MyMHA (Part 5), MyGQA (Part 7), GQA_2_MLA (Part 10), reduced_matrices
(Part 13), tiled_rank (Part 6) and is_gqa_representable (Part 11). Each calls the library's single implementation.
"""
from __future__ import annotations

import numpy as np
import torch

from ..convert.linalg import (
    fold_output,
    fold_query,
    is_gqa_representable,
    low_rank_factors,
    tiled_rank,
)
from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.heads import tile_heads

__all__ = ["MyMHA", "MyGQA", "GQA_2_MLA", "reduced_matrices", "tiled_rank", "is_gqa_representable"]


class _StudyNames:
    def _name_sizes(self, D_1, D_2, D_qk, D_v, H):
        self.D_1, self.D_2, self.D_qk, self.D_v, self.H = D_1, D_2, D_qk, D_v, H


class MyMHA(MultiHeadAttention, _StudyNames):
    """Part 5: H heads, W_Q (H*D_qk, D_1), W_K (H*D_qk, D_2), W_V (H*D_v, D_2), W_O (D_1, H*D_v), no bias."""

    def __init__(self, D_1, D_2, D_qk, D_v, H):
        super().__init__(D_1, H, head_dim=D_qk, v_head_dim=D_v, context_dim=D_2)
        self._name_sizes(D_1, D_2, D_qk, D_v, H)

    def forward(self, x, y):
        """x (B, L_1, D_1) attends to y (B, L_2, D_2) -> (B, L_1, D_1)."""
        return super().forward(x, y)


class MyGQA(GroupedQueryAttention, _StudyNames):
    """Part 7: as MyMHA with G key/value heads, query head h reading KV head h mod G."""

    def __init__(self, D_1, D_2, D_qk, D_v, H, G):
        super().__init__(D_1, H, G, head_dim=D_qk, v_head_dim=D_v, context_dim=D_2, grouping="strided")
        self._name_sizes(D_1, D_2, D_qk, D_v, H)
        self.G = G

    def forward(self, x, y):
        return super().forward(x, y)


def GQA_2_MLA(W_M_GQA):
    """Part 10: factor D/r stacked copies of W_M_GQA (r, D) as W_UM_MLA (D, r) @ W_DKV_MLA (r, D) by SVD.

    Prints both shapes and the mean-squared reconstruction error; returns
    (W_DKV_MLA, W_UM_MLA) as numpy arrays.
    """
    w = torch.from_numpy(np.asarray(W_M_GQA, dtype=np.float64))
    r, D = w.shape
    if D % r:
        raise ValueError(f"the number of rows r ({r}) must divide the number of columns D ({D})")
    tiled = tile_heads(w, D // r, 1, "strided")  # (D, D): D/r copies stacked
    up, down, _ = low_rank_factors(tiled, r)  # (D, r), (r, D)
    W_UM_MLA, W_DKV_MLA = up.numpy(), down.numpy()
    print(f"Shape of W_UM_MLA: {W_UM_MLA.shape}")
    print(f"Shape of W_DKV_MLA: {W_DKV_MLA.shape}")
    print(f"Mean-squared error: {np.mean((tiled.numpy() - W_UM_MLA @ W_DKV_MLA) ** 2)}")
    return W_DKV_MLA, W_UM_MLA


def reduced_matrices(W_DKV, W_UK, W_UV, W_Q, W_O, H):
    """Part 13: the reduced (absorbed) matrices of Part 12, for a MyMHA with head size r.

    Returns W_K_MLA_hat = W_V_MLA_hat = W_DKV (r, D), W_Q_MLA_hat (H*r, D) and
    W_O_MLA_hat (D, H*r). W_Q_MLA_hat carries the factor sqrt(r / d) that turns
    the reduced model's 1/sqrt(r) score scale back into the original 1/sqrt(d).
    """
    r = W_DKV.shape[0]
    d = W_Q.shape[0] // H
    return W_DKV, W_DKV, fold_query(W_Q, W_UK, H) * (r / d) ** 0.5, fold_output(W_O, W_UV, H)

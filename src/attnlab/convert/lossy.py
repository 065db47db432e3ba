"""The lossy conversions without RoPE: mha_to_gqa (mean or fit) and mha_to_mla (truncated SVD).

Notation as in exact.py. mha_to_gqa pools (mean) or fits a shared subspace per group, per-head maps folded into W_Q
and W_O; mha_to_mla truncates the SVD of the stacked [W_K; W_V], optionally whitened by calibration activations and
K/V balanced (transforms.kv_balance). Each returns the report of every error (report.py).
"""
from __future__ import annotations

import math

import torch

from ..modules import checks
from ..modules.gqa import GroupedQueryAttention
from ..modules.heads import kv_head_of, tile_heads
from .base import F64, _bias, _expect, _gqa, _mla, _no_rope, _set
from .linalg import rank_for_energy, whitening
from .report import _report

# -- lossy -----------------------------------------------------------------------------------------
MHA_TO_GQA_METHODS = ("mean", "fit")



def mha_to_gqa(mha: GroupedQueryAttention, num_kv_heads: int, *,
               method: str = "mean",  # "mean" (the GQA paper's uptraining start) or "fit"
               calibration: torch.Tensor | None = None,  # inputs that whiten "fit"'s SVD
               grouping: str | None = None):  # which query heads share a KV head in the result; None: the input's
    """MHA (or a GQA with more KV heads) -> GQA with num_kv_heads, lossy. Needs a module without RoPE.

    "mean": each KV head is the mean of its query heads' K (V) projections and biases. "fit": per group, the best
    shared d-dim subspace of the keys (values) by SVD, each head's d x d map into it folded into W_Q (W_O), biases as an
    extra input column; exact where a group shares one, never worse than mean on the objective it minimises.
    """
    _expect(mha, GroupedQueryAttention, "mha_to_gqa")
    checks.positive_int("num_kv_heads", num_kv_heads)
    H = mha.num_heads
    checks.divides(H, num_kv_heads)
    if method not in MHA_TO_GQA_METHODS:
        raise ValueError(f"method must be one of {MHA_TO_GQA_METHODS}, got {method!r}")
    if mha.num_kv_heads % num_kv_heads and mha.num_kv_heads != H:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide the input's num_kv_heads "
                         f"({mha.num_kv_heads})")
    grouping = grouping or mha.grouping
    G, d, dv = num_kv_heads, mha.head_dim, mha.v_head_dim
    has_bias = mha.W_Q.bias is not None
    new = _gqa(mha, G, bias=has_bias, grouping=grouping)
    src_tile = lambda t: None if t is None else tile_heads(t.detach(), H, mha.num_kv_heads, mha.grouping)  # noqa
    wk, wv = src_tile(mha.W_K.weight), src_tile(mha.W_V.weight)  # (H*d, D_2), per query head
    bk, bv = src_tile(_bias(mha.W_K)), src_tile(_bias(mha.W_V))
    owner = kv_head_of(H, G, grouping)
    members = [torch.nonzero(owner == g).flatten() for g in range(G)]
    if method == "mean":
        def pool(w, size):
            w = w.reshape(H, size, -1)
            return torch.stack([w[idx].mean(0) for idx in members]).reshape(G * size, -1)
        _set(new.W_Q, mha.W_Q.weight, _bias(mha.W_Q))
        _set(new.W_K, pool(wk, d), None if bk is None else pool(bk[:, None], d)[:, 0])
        _set(new.W_V, pool(wv, dv), None if bv is None else pool(bv[:, None], dv)[:, 0])
        _set(new.W_O, mha.W_O.weight, _bias(mha.W_O))
        return new, _report(mha, new, False, calibration=calibration,
                            notes=["mean pooling of each group's K/V projections and biases"])
    _no_rope(mha, "mha_to_gqa(method='fit')")
    L = _augmented_whitening(calibration, mha.context_dim, has_bias)
    k_shared, k_maps = _shared_subspace(_augment(wk, bk), H, d, members, L)
    v_shared, v_maps = _shared_subspace(_augment(wv, bv), H, dv, members, L)
    wq = mha.W_Q.weight.detach().to(F64).reshape(H, d, -1)
    wo = mha.W_O.weight.detach().to(F64).reshape(-1, H, dv)
    q_new = (k_maps.transpose(1, 2) @ wq).reshape(H * d, -1)  # T_h^T W_Q_h
    o_new = torch.einsum("ehj,hjk->ehk", wo, v_maps).reshape(-1, H * dv)  # W_O_h T_h
    bq = _bias(mha.W_Q)
    q_bias = None if bq is None else (k_maps.transpose(1, 2) @ bq.to(F64).reshape(H, d, 1)).reshape(-1)
    dt = mha._anchor.dtype
    cast = lambda t: None if t is None else t.to(dt)  # noqa: E731
    _set(new.W_Q, q_new.to(dt), cast(q_bias))
    _set(new.W_K, k_shared[:, :mha.context_dim].to(dt), cast(k_shared[:, -1]) if has_bias else None)
    _set(new.W_V, v_shared[:, :mha.context_dim].to(dt), cast(v_shared[:, -1]) if has_bias else None)
    _set(new.W_O, o_new.to(dt), _bias(mha.W_O))
    notes = ["shared subspace per group (SVD), per-head maps folded into W_Q / W_O",
             "whitened by calibration inputs" if calibration is not None else "weight space (no calibration)"]
    return new, _report(mha, new, False, bases=False, calibration=calibration,
                        notes=notes)



def _augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    w = w.to(F64)
    return w if b is None else torch.cat([w, b.to(F64)[:, None]], 1)



def _augmented_whitening(calibration, width: int, bias: bool) -> torch.Tensor | None:
    if calibration is None:
        return None
    if calibration.shape[-1] != width:
        raise ValueError(f"calibration has last dimension {calibration.shape[-1]}, expected {width}")
    if not bias:
        return whitening(calibration)  # its covariance computed once per calibration tensor
    y = calibration.reshape(-1, width).to(F64)
    return whitening(torch.cat([y, torch.ones(y.shape[0], 1, dtype=F64)], 1))



def _shared_subspace(w: torch.Tensor, H: int, size: int, members, L: torch.Tensor | None):
    """Per group: a (size x in) shared projection R_g and per-head maps T_h with W_h ~ T_h R_g."""
    per_head = w.reshape(H, size, -1)  # (H, size, in)
    shared, maps = [], torch.zeros(H, size, size, dtype=F64)
    for idx in members:
        stack = per_head[idx].reshape(-1, per_head.shape[-1])  # (C*size, in)
        a = stack @ L if L is not None else stack
        _, s, vh = torch.linalg.svd(a, full_matrices=False)
        basis = vh[:size]  # (size, in), orthonormal rows in whitened space
        scale = s[:size].clamp_min(s[0] * 1e-12 if s.numel() else 1.0) / math.sqrt(len(idx))
        r_white = scale[:, None] * basis  # (size, in)
        for h in idx.tolist():
            m_h = per_head[h] @ L if L is not None else per_head[h]
            maps[h] = (m_h @ basis.T) / scale[None, :]  # T_h = M_h V_d diag(1/scale)
        r = r_white if L is None else torch.linalg.solve_triangular(L, r_white, upper=False, left=False)
        shared.append(r)
    return torch.cat(shared), maps



def mha_to_mla(module: GroupedQueryAttention, *,
               latent_dim: int | None = None,  # the rank
               energy: float | None = None,  # or the least rank keeping this share of the squared singular values
               joint: bool = True,  # one latent from [W_K; W_V]; False: K and V apart (latent_dim split evenly)
               calibration: torch.Tensor | None = None):  # the K/V projections' inputs (..., context_dim)
    """MHA or GQA -> MLA by truncated SVD, lossy (exact at full rank; neither latent_dim nor energy: full rank).

    With calibration the SVD is of W L, L L^T the inputs' covariance, and L is undone after: the best rank for those
    inputs, not for the weights. energy applies per matrix when joint=False. K/V biases go to W_UK/W_UV, exactly.
    """
    _expect(module, GroupedQueryAttention, "mha_to_mla")
    _no_rope(module, "mha_to_mla")
    mla, exact, energy_fraction, notes = _svd_latent(module, latent_dim, energy, joint, calibration)
    return mla, _report(module, mla, exact, calibration=calibration, energy=energy_fraction, notes=notes)



def _svd_latent(module: GroupedQueryAttention, latent_dim, energy, joint, calibration, balance: bool = False):
    """mha_to_mla's MLA without its report: (mla, exact?, energy kept, notes).

    balance (joint only): BKV, W_K scaled by transforms.kv_balance before the SVD and the
    key up-projection divided by it after (exact at full rank).
    """
    if latent_dim is not None and energy is not None:
        raise ValueError("give latent_dim or energy, not both")
    if latent_dim is not None:
        checks.positive_int("latent_dim", latent_dim)
    H, G, d, dv = module.num_heads, module.num_kv_heads, module.head_dim, module.v_head_dim
    wk, wv = module.W_K.weight.detach().to(F64), module.W_V.weight.detach().to(F64)
    L = _augmented_whitening(calibration, module.context_dim, False)

    def factor(block, rank, name):
        """(up, down, kept power, total power, full rank?) of the truncated SVD of block (whitened)."""
        a = block @ L if L is not None else block
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        full = int((s > s[0] * 1e-12).sum())
        if rank is None:
            rank = rank_for_energy(s, energy) if energy is not None else full
        if not 1 <= rank <= len(s):
            raise ValueError(f"latent_dim for {name} ({rank}) must be between 1 and {len(s)}")
        down = s[:rank, None] * vh[:rank]
        if L is not None:
            down = torch.linalg.solve_triangular(L, down, upper=False, left=False)
        power = s.to(F64) ** 2
        return u[:, :rank], down, float(power[:rank].sum()), float(power.sum()), rank >= full

    if joint:
        from .transforms import kv_balance
        alpha = kv_balance(wk, wv, L) if balance else 1.0
        up, down, kept, total, exact = factor(torch.cat([wk * alpha, wv]), latent_dim, "[W_K; W_V]")
        up_k = tile_heads(up[:G * d] / alpha, H, G, module.grouping)
        up_v = tile_heads(up[G * d:], H, G, module.grouping)
    else:
        if latent_dim is not None and latent_dim < 2:
            raise ValueError(f"latent_dim ({latent_dim}) must be at least 2 with joint=False")
        rk = None if latent_dim is None else latent_dim // 2
        rv = None if latent_dim is None else latent_dim - latent_dim // 2
        uk, dk, kk, tk, fk = factor(wk, rk, "W_K")
        uv, dvv, kv, tv, fv = factor(wv, rv, "W_V")
        down = torch.cat([dk, dvv])
        up_k = tile_heads(torch.cat([uk, torch.zeros(G * d, dvv.shape[0], dtype=F64)], 1), H, G, module.grouping)
        up_v = tile_heads(torch.cat([torch.zeros(G * dv, dk.shape[0], dtype=F64), uv], 1), H, G, module.grouping)
        kept, total, exact = kk + kv, tk + tv, fk and fv
    has_bias = module.W_Q.bias is not None
    mla = _mla(module, down.shape[0], has_bias)
    dt = module._anchor.dtype
    tile = lambda t: None if t is None else tile_heads(t.detach(), H, G, module.grouping)  # noqa: E731
    _set(mla.W_Q, module.W_Q.weight, _bias(module.W_Q))
    _set(mla.W_DKV, down.to(dt))
    _set(mla.W_UK, up_k.to(dt), tile(_bias(module.W_K)))
    _set(mla.W_UV, up_v.to(dt), tile(_bias(module.W_V)))
    _set(mla.W_O, module.W_O.weight, _bias(module.W_O))
    notes = [f"latent r = {down.shape[0]}, {'joint' if joint else 'split'} SVD"
             + (", whitened by calibration" if L is not None else "") + (", K/V balanced" if balance else "")]
    return mla, exact, kept / total, notes

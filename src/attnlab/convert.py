"""Conversions between MHA, GQA and MLA: exact where the mathematics allows, with a report of every error.

Every function takes a module and returns (new_module, ConversionReport); the
input is never changed. Notation: H query heads, G KV heads, C = H/G, d query/key
head size, dv value head size, r latent size, D_1 = dim, D_2 = context_dim.

Exact:   gqa_to_mha, gqa_to_mla, mla_to_mha, absorb.
Lossy:   mha_to_gqa (mean pooling, or "fit": a shared subspace per group with
         per-head maps folded into W_Q and W_O), mha_to_mla (truncated SVD of the
         stacked [W_K; W_V], optionally whitened by calibration activations).
Decoupled RoPE (GQA with RoPE -> DeepSeek's MLA) lives in decoupled.py.

report.py measures what a conversion must preserve (ConversionReport). Biases are
not part of its matrix errors; how each conversion carries them is stated in its
docstring.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from . import checks
from .gqa import GroupedQueryAttention, MultiHeadAttention
from .linalg import (factor_tiled, fold_output, fold_query, kv_head_of, rank_for_energy, svd_factors,
                     tile_heads, whitening)
from .mla import MultiHeadLatentAttention
from .report import ConversionReport, _report, matrix_errors, probe_error  # noqa: F401 - re-exported; defined in report.py

F64 = torch.float64


# -- helpers ---------------------------------------------------------------------------------------
def _expect(module, cls, fn: str):
    if not isinstance(module, cls):
        raise TypeError(f"{fn} takes a {cls.__name__}, got {type(module).__name__}")


def _no_rope(module, fn: str):
    if getattr(module, "rope", None) is not None:
        raise ValueError(f"{fn} does not support modules with RoPE yet "
                         f"(rotary embeddings do not commute with the maps this conversion folds)")


def _linear_mla(mla: MultiHeadLatentAttention, fn: str, allow_rope_after_up: bool = False):
    problems = [name for name, bad in (("latent_norm", mla.kv_norm is not None), ("rope_dim > 0", mla.rope_dim > 0),
                                       ("q_latent_dim", mla.W_DQ is not None),
                                       ("rope_after_up", mla.rope_after_up and not allow_rope_after_up)) if bad]
    if problems:
        raise ValueError(f"{fn} needs an MLA whose keys and values are linear in the input; "
                         f"this one has {', '.join(problems)}")


def _like(m: nn.Module) -> dict:
    w = m._anchor
    return dict(device=w.device, dtype=w.dtype)


def _bias(lin: nn.Linear):
    return None if lin.bias is None else lin.bias.detach()


def _set(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        lin.weight.copy_(weight)
        if lin.bias is not None:
            lin.bias.copy_(bias if bias is not None else torch.zeros_like(lin.bias))


def _gqa(src, num_kv_heads: int, *, bias: bool, grouping: str, head_dim=None, v_head_dim=None):
    """A new GroupedQueryAttention with the geometry of src (RoPE copied when present)."""
    new = GroupedQueryAttention(src.dim, src.num_heads, num_kv_heads, head_dim=head_dim or src.head_dim,
                                v_head_dim=v_head_dim or src.v_head_dim, context_dim=src.context_dim, bias=bias,
                                grouping=grouping, **_like(src))
    new.rope = copy.deepcopy(getattr(src, "rope", None))
    return new


# -- exact -----------------------------------------------------------------------------------------
def gqa_to_mha(gqa: GroupedQueryAttention):
    """GQA -> MHA, exact: each query head gets its own copy of its KV head (honouring grouping).

    Biases on K and V are tiled with their heads; Q and O are copied.
    """
    _expect(gqa, GroupedQueryAttention, "gqa_to_mha")
    H, G = gqa.num_heads, gqa.num_kv_heads
    has_bias = gqa.W_Q.bias is not None
    mha = MultiHeadAttention(gqa.dim, H, head_dim=gqa.head_dim, v_head_dim=gqa.v_head_dim,
                             context_dim=gqa.context_dim, bias=has_bias, **_like(gqa))
    mha.rope = copy.deepcopy(gqa.rope)
    tile = lambda t: None if t is None else tile_heads(t.detach(), H, G, gqa.grouping)  # noqa: E731
    _set(mha.W_Q, gqa.W_Q.weight, _bias(gqa.W_Q))
    _set(mha.W_K, tile(gqa.W_K.weight), tile(_bias(gqa.W_K)))
    _set(mha.W_V, tile(gqa.W_V.weight), tile(_bias(gqa.W_V)))
    _set(mha.W_O, gqa.W_O.weight, _bias(gqa.W_O))
    return mha, _report(gqa, mha, True)


def gqa_to_mla(gqa: GroupedQueryAttention, *, shared: bool = True, method: str | None = None):
    """GQA (or MHA) -> MLA, exact, using the tiling's structure (never an SVD of the tiled matrix).

    shared=True: one latent for K and V, the rows of the stacked block [W_K; W_V]
    (G*(d + dv) x D_2): method "select" uses the block itself as W_DKV and 0/1
    up-projections (r = G*(d+dv), no arithmetic); "block-svd" factors the block by
    SVD (r = its rank, which is below G*(d+dv) when D_2 is smaller). Default: select
    when G*(d+dv) <= D_2, else block-svd.
    shared=False: Part 9 per matrix, K and V each factored through their own
    r = rank <= G*d latent by the block SVD; the MLA latent is the two side by side.
    K/V biases move to the up-projections (W_UK, W_UV), exactly. A GQA with RoPE becomes
    an MLA with rope_after_up=True: the latent holds the keys before rotation and RoPE
    is applied after the up-projection, as the GQA applied it (expanded path only).
    With method "select" the MLA records its kv_tiling and attends on slices of its
    cache as the GQA did (MultiHeadLatentAttention's docstring), at the GQA's cost.
    """
    _expect(gqa, GroupedQueryAttention, "gqa_to_mla")
    H, G, d, dv = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim, gqa.v_head_dim
    wk, wv = gqa.W_K.weight.detach(), gqa.W_V.weight.detach()
    if shared:
        stacked = torch.cat([wk, wv])  # (G*(d+dv), D_2)
        method = method or ("select" if stacked.shape[0] <= gqa.context_dim else "block-svd")
        if method not in ("select", "block-svd"):
            raise ValueError(f"method must be 'select' or 'block-svd', got {method!r}")
        if method == "select":
            down = stacked
            eye = torch.eye(stacked.shape[0], dtype=wk.dtype, device=wk.device)  # latent entry j = row j
            up_k = tile_heads(eye[:G * d], H, G, gqa.grouping)  # (H*d, r)
            up_v = tile_heads(eye[G * d:], H, G, gqa.grouping)  # (H*dv, r)
        else:
            u, down = svd_factors(stacked.to(F64))
            down = down.to(wk.dtype)
            up_k = tile_heads(u[:G * d].to(wk.dtype), H, G, gqa.grouping)
            up_v = tile_heads(u[G * d:].to(wk.dtype), H, G, gqa.grouping)
    else:
        method = method or "block-svd"
        uk, dk = factor_tiled(wk.to(F64), H, G, gqa.grouping, method)
        uv, dv_ = factor_tiled(wv.to(F64), H, G, gqa.grouping, method)
        down = torch.cat([dk, dv_]).to(wk.dtype)
        up_k = torch.cat([uk, torch.zeros(H * d, dv_.shape[0], dtype=F64)], 1).to(wk.dtype)
        up_v = torch.cat([torch.zeros(H * dv, dk.shape[0], dtype=F64), uv], 1).to(wk.dtype)
    has_bias = gqa.W_Q.bias is not None
    mla = _mla(gqa, down.shape[0], has_bias)
    tile = lambda t: None if t is None else tile_heads(t.detach(), H, G, gqa.grouping)  # noqa: E731
    _set(mla.W_Q, gqa.W_Q.weight, _bias(gqa.W_Q))
    _set(mla.W_DKV, down)
    _set(mla.W_UK, up_k, tile(_bias(gqa.W_K)))
    _set(mla.W_UV, up_v, tile(_bias(gqa.W_V)))
    _set(mla.W_O, gqa.W_O.weight, _bias(gqa.W_O))
    notes = [f"latent r = {down.shape[0]} ({'shared' if shared else 'per matrix'}, method {method})"]
    if mla.detect_kv_tiling():  # method "select": attend on latent slices as the GQA does (mla.py)
        notes.append(f"W_UK/W_UV are the GQA tiling ({mla.kv_tiling}): decode reads latent slices, no up-projection")
    return mla, _report(gqa, mla, True, notes=notes)


def _mla(src, latent_dim: int, bias: bool) -> MultiHeadLatentAttention:
    """An MLA with src's geometry; a RoPE'd src gives rope_after_up with src's rotary embedding."""
    import warnings
    with warnings.catch_warnings():  # exact conversions may need a latent as wide as the input
        warnings.simplefilter("ignore", UserWarning)
        mla = MultiHeadLatentAttention(src.dim, src.num_heads, latent_dim, head_dim=src.head_dim,
                                       v_head_dim=src.v_head_dim, context_dim=src.context_dim, bias=bias,
                                       rope_after_up=src.rope is not None, **_like(src))
    mla.rope = copy.deepcopy(src.rope)
    return mla


def mla_to_mha(mla: MultiHeadLatentAttention):
    """MLA -> MHA, exact: W_K = W_UK W_DKV, W_V = W_UV W_DKV (biases: W_UK b_DKV + b_UK).

    The MLA's softmax scale is folded into W_Q (and its bias) when it is not 1/sqrt(d).
    Needs a linear MLA: no latent norm, no decoupled RoPE, no low-rank query
    (rope_after_up is fine: the MHA applies the same RoPE to its keys).
    """
    _expect(mla, MultiHeadLatentAttention, "mla_to_mha")
    _linear_mla(mla, "mla_to_mha", allow_rope_after_up=True)
    has_bias = any(lin.bias is not None for lin in (mla.W_Q, mla.W_DKV, mla.W_UK, mla.W_UV, mla.W_O))
    mha = MultiHeadAttention(mla.dim, mla.num_heads, head_dim=mla.head_dim, v_head_dim=mla.v_head_dim,
                             context_dim=mla.context_dim, bias=has_bias, **_like(mla))
    mha.rope = copy.deepcopy(mla.rope) if mla.rope_after_up else None
    factor = mla.scale * math.sqrt(mla.head_dim)
    b_c = _bias(mla.W_DKV)

    def up(lin):
        w = lin.weight.detach()
        b = _bias(lin)
        if b_c is not None:
            b = w @ b_c + (b if b is not None else 0)
        return w @ mla.W_DKV.weight.detach(), b

    bq = _bias(mla.W_Q)
    _set(mha.W_Q, mla.W_Q.weight.detach() * factor, None if bq is None else bq * factor)
    _set(mha.W_K, *up(mla.W_UK))
    _set(mha.W_V, *up(mla.W_UV))
    _set(mha.W_O, mla.W_O.weight, _bias(mla.W_O))
    return mha, _report(mla, mha, True)


def absorb(mla: MultiHeadLatentAttention):
    """MLA -> its absorbed form (Part 12) as a module: multi-query attention with head size r.

    One KV head of size r whose key and value projections are both W_DKV (so K = V = c),
    W_Q = the stacked W_UK_h^T W_Q_h (times sqrt(r) * scale so that the 1/sqrt(r)
    scale of an r-sized head gives the MLA's scores), W_O = [W_O_h W_UV_h]_h. The
    same matrices as `usaaio.reduced_matrices`, from the same functions.
    Biases: b_Q maps like W_Q; the W_UK bias drops out exactly (it shifts a query's
    scores equally); the W_UV bias moves into b_O (W_O b_UV), exact wherever a query
    attends to at least one key.
    """
    _expect(mla, MultiHeadLatentAttention, "absorb")
    _linear_mla(mla, "absorb")
    H, r = mla.num_heads, mla.latent_dim
    has_bias = any(lin.bias is not None for lin in (mla.W_Q, mla.W_DKV, mla.W_UK, mla.W_UV, mla.W_O))
    mqa = GroupedQueryAttention(mla.dim, H, 1, head_dim=r, v_head_dim=r, context_dim=mla.context_dim,
                                bias=has_bias, **_like(mla))
    factor = mla.scale * math.sqrt(r)
    w_uk = mla.W_UK.weight.detach()
    bq = _bias(mla.W_Q)
    q_bias = None if bq is None else fold_query(bq[:, None], w_uk, H)[:, 0] * factor
    o_bias = _bias(mla.W_O)
    if mla.W_UV.bias is not None:
        extra = mla.W_O.weight.detach() @ mla.W_UV.bias.detach()
        o_bias = extra if o_bias is None else o_bias + extra
    _set(mqa.W_Q, fold_query(mla.W_Q.weight.detach(), w_uk, H) * factor, q_bias)
    _set(mqa.W_K, mla.W_DKV.weight, _bias(mla.W_DKV))
    _set(mqa.W_V, mla.W_DKV.weight, _bias(mla.W_DKV))
    _set(mqa.W_O, fold_output(mla.W_O.weight.detach(), mla.W_UV.weight.detach(), H), o_bias)
    notes = ["K and V projections of the absorbed form are both W_DKV: a cache needs only r values per token"]
    return mqa, _report(mla, mqa, True, bases=False, notes=notes)


# -- lossy -----------------------------------------------------------------------------------------
MHA_TO_GQA_METHODS = ("mean", "fit")


def mha_to_gqa(mha: GroupedQueryAttention, num_kv_heads: int, *, method: str = "mean",
               calibration: torch.Tensor | None = None, grouping: str | None = None):
    """MHA (or a GQA with more KV heads) -> GQA with num_kv_heads, lossy.

    method="mean": each KV head is the mean of the K (V) projections and biases of the
      query heads it serves (the GQA paper's uptraining initialisation).
    method="fit": per group, the best d-dimensional subspace shared by the group's
      key (value) projections (an SVD of the stacked heads, whitened by `calibration`
      inputs when given), then each query head's own d x d map from the shared keys to
      its original keys is folded into W_Q (for values, into W_O). Exact when the
      heads of a group already share a subspace; never worse than mean on the
      weight-space (or calibration) objective it minimises. Biases ride along as an
      extra input column. Needs a module without RoPE.
    grouping: which query heads share a KV head in the result (default: the input's).
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
    y = calibration.reshape(-1, width).to(F64)
    if bias:
        y = torch.cat([y, torch.ones(y.shape[0], 1, dtype=F64)], 1)
    return whitening(y)


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


def mha_to_mla(module: GroupedQueryAttention, *, latent_dim: int | None = None, energy: float | None = None,
               joint: bool = True, calibration: torch.Tensor | None = None):
    """MHA or GQA -> MLA by truncated SVD, lossy (exact at full rank).

    joint=True: one shared latent from the SVD of the stacked [W_K; W_V] block;
    joint=False: K and V factored separately (latent_dim split evenly; energy per matrix).
    The rank is latent_dim, or the smallest keeping `energy` of the squared singular
    values, or (neither given) the full numerical rank. With `calibration` inputs of
    the K/V projections (..., context_dim), the SVD is taken of W L where L L^T is their
    covariance, and L is undone afterwards: the best rank for those inputs, not for
    the weights. K/V biases go to the up-projections, exactly.
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

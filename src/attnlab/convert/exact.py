"""The exact conversions: gqa_to_mha, gqa_to_mla, mla_to_mha, absorb (Parts 8-12 as code).

Each takes a module and returns (new_module, ConversionReport); the input is never changed. Exact: the report's
float64 errors are rounding only, biases included. Notation: H query heads, G KV heads, C = H/G, d query/key head
size, dv value head size, r latent size, D_1 = dim, D_2 = context_dim.
"""
from __future__ import annotations

import copy
import math

import torch

from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.heads import tile_heads
from ..modules.mla import MultiHeadLatentAttention
from .base import F64, _bias, _expect, _like, _linear_mla, _mla, _set, copy_head_norms
from .linalg import factor_tiled, fold_output, fold_query, svd_factors
from .report import _report


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


def gqa_to_mla(gqa: GroupedQueryAttention, *,
               shared: bool = True,  # one latent for K and V; False: K's and V's latents side by side (Part 9)
               method: str | None = None):  # "select" or "block-svd"; None: select where G(d + dv) <= D_2
    """GQA (or MHA) -> MLA, exact, from the tiling's structure (never an SVD of the tiled matrix).

    "select": [W_K; W_V] is W_DKV with 0/1 up-projections (r = G(d + dv)); the MLA records its kv_tiling and attends
    on its cache as the GQA did, at the GQA's cost. "block-svd": the block's SVD, r = its rank. K/V biases move to
    W_UK/W_UV. q/k norms, softmax scale and sliding window carry over; RoPE gives rope_after_up=True.
    """
    _expect(gqa, GroupedQueryAttention, "gqa_to_mla", carries=True)
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
    # per-head q/k norms: the latent holds each KV head's key before its norm and W_UK hands every query head that
    # vector, which the MLA normalises (one gain for all heads) and rotates as the GQA did. With RoPE
    # (rope_after_up) the latent holds the keys before rotation, rotated after the up-projection (expanded path only)
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


def mla_to_mha(mla: MultiHeadLatentAttention):
    """MLA -> MHA, exact: W_K = W_UK W_DKV, W_V = W_UV W_DKV (biases: W_UK b_DKV + b_UK).

    The softmax scale folds into W_Q and its bias; with per-head q/k norms (which would undo the fold) it, the norms
    and any sliding window carry over. Needs a linear MLA: no latent norm, decoupled RoPE or low-rank query
    (rope_after_up is fine). Anything else is refused.
    """
    _expect(mla, MultiHeadLatentAttention, "mla_to_mha", carries=True)
    _linear_mla(mla, "mla_to_mha", allow_rope_after_up=True)
    has_bias = any(lin.bias is not None for lin in (mla.W_Q, mla.W_DKV, mla.W_UK, mla.W_UV, mla.W_O))
    normed = mla.k_head_norm is not None
    head = mla._head_config()
    if not normed:
        head["softmax_scale"] = None  # folded into W_Q below
    mha = MultiHeadAttention(mla.dim, mla.num_heads, head_dim=mla.head_dim, v_head_dim=mla.v_head_dim,
                             context_dim=mla.context_dim, bias=has_bias, **head, **_like(mla))
    mha.rope = copy.deepcopy(mla.rope) if mla.rope_after_up else None
    copy_head_norms(mha, mla)
    factor = 1.0 if normed else mla.scale * math.sqrt(mla.head_dim)
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

    One KV head of size r, K = V = c (both W_DKV); W_Q = stacked W_UK_h^T W_Q_h x sqrt(r) x scale; W_O = [W_O_h
    W_UV_h]_h: `usaaio.reduced_matrices`'s matrices. b_Q maps like W_Q; b_UK drops out (an equal shift of a query's
    scores); b_UV moves into b_O (W_O b_UV), exact wherever a query attends to at least one key.
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



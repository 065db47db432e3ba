"""A keys-whole MLA (a Qwen3 or Gemma 3 layer converted with its keys whole) as the GQA of the source's shape.

keys_whole_to_gqa: keys are the MLA's rope key split by KV head, norms the MLA's, values v_g = A_g W_DKV x (A_g: the
value up-projection of KV head g's first query head; a healed head's A_h = M_h A_g puts M_h in its W_O block).
value_basis: U, so a cache holds the latent again (attnlab.hf.KVCache: rows [c | k], c = U^+ v). Exact to float64.
"""
from __future__ import annotations

import torch

from ..modules.gqa import GroupedQueryAttention
from ..modules.heads import kv_head_of
from ..modules.mla import MultiHeadLatentAttention
from ..modules.rope import RotaryEmbedding
from .base import F64, _like, _set, copy_head_norms

FOLD_RTOL = 1e-6  # A_h = M_h A_g must hold to this share of |A_h| (float32 weights' rounding is 6e-8)


def value_heads(mla: MultiHeadLatentAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (G, dv, r): each KV head's value up-projection, M (H, dv, dv) or None per head: what W_O's block of that
    query head is multiplied by, None where A_h is A_g itself). ValueError naming the head where no M_h exists."""
    H, G, dv = mla.num_heads, mla.rope_kv_heads, mla.v_head_dim
    own = kv_head_of(H, G, mla.rope_grouping)
    up = mla.W_UV.weight.detach().to(F64).reshape(H, dv, -1)  # (H, dv, r)
    first = [int(torch.nonzero(own == g)[0]) for g in range(G)]
    A = up[first]  # (G, dv, r); M_h = A_h A_g^+ exists where A_g has full column rank
    folds = []
    for h in range(H):
        a = A[int(own[h])]
        if torch.equal(up[h], a):
            folds.append(None)
            continue
        m = up[h] @ torch.linalg.pinv(a)  # (dv, dv)
        if (m @ a - up[h]).norm() > FOLD_RTOL * up[h].norm():
            raise ValueError(f"query head {h}'s values are not a function of KV head {int(own[h])}'s (a heal moved "
                             f"them apart, latent {a.shape[-1]} > head size {dv}): the source's GQA cannot hold them")
        folds.append(m)
    return A, folds


def value_basis(mla: MultiHeadLatentAttention) -> torch.Tensor:
    """U (G dv, r): the GQA's values of every KV head are U c for the MLA's latent c (keys_whole_to_gqa)."""
    A, _ = value_heads(mla)
    return A.reshape(-1, A.shape[-1]).to(mla.W_UV.weight.dtype)


def keys_whole_to_gqa(mla: MultiHeadLatentAttention) -> GroupedQueryAttention:
    """The GQA of the source's shape that computes what the keys-whole MLA computes (module docstring)."""
    if not isinstance(mla, MultiHeadLatentAttention) or not mla.keys_whole:
        raise TypeError(f"keys_whole_to_gqa takes a keys-whole MultiHeadLatentAttention, got {type(mla).__name__}")
    if mla.kv_norm is not None or mla.W_Q is None or any(
            getattr(lin, "bias", None) is not None for lin in (mla.W_Q, mla.W_DKV, mla.W_KR, mla.W_UV, mla.W_O)):
        raise ValueError("keys_whole_to_gqa needs an MLA without a latent norm, a query latent or biases "
                         "(what a keys-whole conversion of Qwen3 or Gemma 3 makes)")
    H, G, p, dv = mla.num_heads, mla.rope_kv_heads, mla.rope_dim, mla.v_head_dim
    d = p // G
    own = kv_head_of(H, G, mla.rope_grouping)
    parts = mla._by_head(torch.arange(p))  # (G, d): each KV head's dims of the rope key, in its rotary order
    gqa = GroupedQueryAttention(mla.dim, H, G, head_dim=d, v_head_dim=dv, context_dim=mla.context_dim,
                                grouping=mla.rope_grouping, **mla._head_config(), **_like(mla))
    gqa.rope = RotaryEmbedding(d, mla.rope.base, interleaved=mla.rope.interleaved,
                               inv_freq=mla.rope.inv_freq[:d // 2].clone(), scaling=mla.rope.scaling)
    wq = mla.W_Q.weight.detach().reshape(H, p, -1)
    A, folds = value_heads(mla)
    wo = mla.W_O.weight.detach().to(F64).reshape(mla.W_O.out_features, H, dv).clone()
    for h, m in enumerate(folds):
        if m is not None:
            wo[:, h] = wo[:, h] @ m
    dt = mla.W_Q.weight.dtype
    _set(gqa.W_Q, torch.stack([wq[h, parts[int(own[h])]] for h in range(H)]).reshape(H * d, -1))
    _set(gqa.W_K, mla.W_KR.weight.detach()[parts.reshape(-1)])
    _set(gqa.W_V, (A.reshape(G * dv, -1) @ mla.W_DKV.weight.detach().to(F64)).to(dt))
    _set(gqa.W_O, wo.reshape(mla.W_O.out_features, H * dv).to(dt))
    copy_head_norms(gqa, mla)
    return gqa

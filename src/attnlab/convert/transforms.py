"""Transforms that concentrate what a lossy GQA -> MLA conversion keeps, applied before the cut (TransMLA's ideas).

RoRoPE: frequency_mixes mixes each frequency's G key planes (folded into the queries, exact); select_planes (one layer)
or shared_planes (a whole model) choose the planes that keep rotating; rorope_split splits the scores. BKV: kv_balance
scales W_K before the joint SVD of [W_K; W_V]. Core module: torch only.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64
PLANE_ORDERS = ("frequency", "score")

# Notation: H query heads, G KV heads, d head_dim, half = d / 2 rotary pairs per head, i a rotary pair (one frequency),
# j a component of the G planes of that frequency, P planes that keep their rotation (rope_dim = 2 P), D_1 = dim,
# D_2 = context_dim.
#
# RoRoPE (TransMLA's idea, written from its algebra). For frequency i every KV head g has a 2-D key plane k_g^i,
# rotated by the same angle at a given position. An orthogonal G x G matrix U_i mixing the heads, k'^i = U_i k^i
# (heads stacked), commutes with that rotation: R k'_j = sum_g U_i[j, g] R k_g. Since k_g = sum_j U_i[j, g] k'_j,
# query head h (reading KV head g(h)) scores
#     q_h . k_g(h) = sum_j (U_i[j, g(h)] q_h^i) . k'_j^i,
# so the mix is folded into the queries and every score is unchanged. With U_i the principal directions of the
# calibrated keys of frequency i (frequency_mixes), component j = 0 carries most of that frequency's energy; the planes
# that keep rotation are chosen among the G * half mixed planes, and the rest lose it. The rest, summed back, is
#     k_nope_g^i = (N_i k^i)_g,  N_i = I - sum_{kept j} U_i[j]^T U_i[j]   (projection off the kept rows),
# read by the original queries: a GQA of the same shape whose keys go through the latent (rorope_split). Keeping all
# planes gives N_i = 0 and the exact model.


def pair_dims(head_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two dims of each rotary pair within a head: (i, i + d/2) rotate-half, (2i, 2i+1) interleaved."""
    pairs = torch.arange(head_dim // 2)
    if interleaved:
        return 2 * pairs, 2 * pairs + 1
    return pairs, pairs + head_dim // 2


def _planes(w: torch.Tensor, dims_a, dims_b) -> torch.Tensor:
    """(heads, d, D) rows -> (heads, half, 2, D): the two rows of every rotary pair."""
    return torch.stack([w[:, dims_a], w[:, dims_b]], dim=2)


def frequency_mixes(wk: torch.Tensor, dims_a, dims_b, covariance: torch.Tensor | None = None):
    """Per rotary pair i, the orthogonal G x G mix U_i whose rows are the principal key directions.

    wk: (G, d, D_2) key rows per KV head; covariance: (D_2, D_2) of the inputs, or None
    (weight space: identity). Returns mixes (half, G, G), rows sorted by energy, and the
    energies (half, G): mean squared norm of each mixed key plane over the inputs.
    """
    planes = _planes(wk.to(F64), dims_a, dims_b).transpose(0, 1)  # (half, G, 2, D_2)
    side = planes if covariance is None else planes @ covariance.to(F64)  # (half, G, 2, D_2)
    gram = torch.einsum("igcx,ihcx->igh", side, planes)  # (half, G, G): sum over both coordinates
    energy, vecs = torch.linalg.eigh(gram)  # ascending
    energy, vecs = energy.flip(-1).clamp_min(0), vecs.flip(-1)  # (half, G), (half, G, G) columns
    return vecs.transpose(1, 2).contiguous(), energy  # rows are directions


def turning(inv_freq: torch.Tensor, context_len: int) -> torch.Tensor:
    """1 - mean cos(theta * delta) over relative positions 0..context_len-1: what dropping a rotation costs."""
    delta = torch.arange(context_len, dtype=F64)
    return 1 - torch.cos(inv_freq.to(F64)[:, None] * delta).mean(-1)  # (half,)


def plane_scores(inv_freq: torch.Tensor, key_energy: torch.Tensor, query_energy: torch.Tensor | None = None,
                 context_len: int = 2048) -> torch.Tensor:
    """(half, G): sqrt(key energy x query energy) x turning(pair) of every mixed plane.

    An estimate of what dropping the plane's rotation changes in the scores over context_len
    positions (query energy 1 where none is given): select_planes' "score" order, and what
    shared_planes sums over layers.
    """
    q = query_energy if query_energy is not None else torch.ones_like(key_energy)
    return (key_energy.to(F64) * q.to(F64)).clamp_min(0).sqrt() * turning(inv_freq, context_len)[:, None]


def _sorted_planes(chosen: torch.Tensor, G: int) -> torch.Tensor:
    """(count, 2) rows [i, j] in slot order: by pair i, then component j."""
    return chosen[torch.argsort(chosen[:, 0] * G + chosen[:, 1])]


def select_planes(count: int, inv_freq: torch.Tensor, key_energy: torch.Tensor,
                  query_energy: torch.Tensor | None = None, *, order: str = "frequency",
                  context_len: int = 2048) -> torch.Tensor:
    """Which `count` of the (half, G) mixed planes keep their rotation: (count, 2) rows [i, j], sorted.

    order "frequency": component 0 of every pair, fastest pair first, then component 1, ... (TransMLA keeps the first
    mixed head's rotation only). order "score": this layer's largest plane_scores (shared_planes: a whole model's).
    """
    half, G = key_energy.shape
    if not 0 <= count <= half * G:
        raise ValueError(f"planes to keep ({count}) must be between 0 and {half * G} (pairs x KV heads)")
    if order not in PLANE_ORDERS:
        raise ValueError(f"plane order must be one of {PLANE_ORDERS}, got {order!r}")
    if order == "frequency":
        speed = torch.argsort(inv_freq, descending=True)  # rank of each pair by speed
        rank = torch.empty(half, dtype=torch.long)
        rank[speed] = torch.arange(half)
        key = torch.arange(G)[None, :] * half + rank[:, None]  # (half, G): component-major
    else:
        value = plane_scores(inv_freq, key_energy, query_energy, context_len)  # (half, G)
        key = torch.argsort(torch.argsort(value.flatten(), descending=True)).reshape(half, G)
    flat = torch.argsort(key.flatten())[:count]
    return _sorted_planes(torch.stack([flat // G, flat % G], dim=1), G)  # (count, 2)


def plane_allocation(scores: torch.Tensor, count: int) -> torch.Tensor:
    """(half,) how many mixed planes of each pair (frequency) keep their rotation, in every layer.

    scores: (layers, half, G) plane_scores of every layer. The c-th plane of pair i adds m[i, c], the sum over layers
    of each layer's c-th largest score, which does not grow with c; so the `count` largest m[i, c] (greedy) maximise
    the summed gain and form a valid allocation.
    """
    _, half, G = scores.shape
    if not 0 <= count <= half * G:
        raise ValueError(f"planes to keep ({count}) must be between 0 and {half * G} (pairs x KV heads)")
    marginal = scores.to(F64).sort(dim=-1, descending=True).values.sum(0)  # (half, G): m[i, c]
    # stable sort: among equal gains the lower c (then the lower i) comes first, so each row's pick is a prefix
    order = torch.sort(marginal.flatten(), descending=True, stable=True).indices[:count]
    return torch.bincount(order // G, minlength=half)


def shared_planes(scores: torch.Tensor, count: int) -> torch.Tensor:
    """(layers, count, 2): per layer the planes [i, j] that keep rotation, the same frequencies in every layer.

    plane_allocation decides how many planes each pair keeps; each layer keeps, for pair i, its own best-scoring
    components. Slots are sorted by pair, then component, so slot s turns at one frequency in every layer: the layers
    share one rotary embedding, as a DeepSeek config holds (select_planes layer by layer would give each its own).
    """
    layers, _, G = scores.shape
    per_pair = plane_allocation(scores, count)  # (half,)
    best = scores.argsort(dim=-1, descending=True)  # (layers, half, G): components by score
    out = []
    for layer in range(layers):
        chosen = [torch.stack([torch.full((int(c),), i), best[layer, i, :int(c)]], dim=1)
                  for i, c in enumerate(per_pair.tolist()) if c]
        rows = torch.cat(chosen) if chosen else torch.zeros(0, 2, dtype=torch.long)
        out.append(_sorted_planes(rows, G))
    return torch.stack(out) if out else torch.zeros(0, count, 2, dtype=torch.long)


def mixed_query_energy(wq: torch.Tensor, owner: torch.Tensor, mixes: torch.Tensor, dims_a, dims_b,
                       covariance: torch.Tensor | None = None) -> torch.Tensor:
    """(half, G): sum over query heads of the energy of their rotary part on mixed plane (i, j)."""
    planes = _planes(wq.to(F64), dims_a, dims_b)  # (H, half, 2, D_1)
    side = planes if covariance is None else planes @ covariance.to(F64)
    per_head = torch.einsum("hicx,hicx->hi", side, planes)  # (H, half)
    weight = mixes[:, :, owner] ** 2  # (half, G, H): U_i[j, g(h)]^2
    return torch.einsum("ijh,hi->ij", weight, per_head)


def rorope_split(wq: torch.Tensor,  # (H, d, D_1) per-head query rows, scale not included
                 wk: torch.Tensor,  # (G, d, D_2) per-head key rows
                 owner: torch.Tensor,  # (H,) each query head's KV head
                 mixes: torch.Tensor,  # (half, G, G), frequency_mixes' rows
                 planes: torch.Tensor,  # (P, 2) rows [pair i, component j]
                 dims_a, dims_b):  # pair_dims
    """Split a RoPE'd GQA's scores into kept rotary planes and a no-rotation remainder.

    Returns q_rope (H, 2P, D_1), k_rope (2P, D_2), k_nope (G, d, D_2): q_h . k_g(h) = q_rope_h . k_rope + q_h .
    k_nope_g(h) before rotation, and the first term rotates exactly. Slots s and s + P hold plane s's two coordinates
    (rotate-half layout of a size-2P RotaryEmbedding; slot s turns at pair planes[s, 0]'s frequency).
    """
    G, P = wk.shape[0], planes.shape[0]
    i, j = planes[:, 0], planes[:, 1]
    u = mixes[i, j]  # (P, G): the mixing row of each kept plane
    kp = _planes(wk, dims_a, dims_b)  # (G, half, 2, D_2)
    qp = _planes(wq, dims_a, dims_b)  # (H, half, 2, D_1)
    k_rope = torch.einsum("pg,gpcx->cpx", u.to(wk.dtype), kp[:, i])  # (2, P, D_2)
    q_rope = u[:, owner].T.to(wq.dtype)[:, None, :, None] * qp[:, i].transpose(1, 2)  # (H, 2, P, D_1)
    keep = torch.zeros(mixes.shape[0], G, G, dtype=mixes.dtype)  # (half, G, G): sum of kept u^T u
    keep.index_put_((i,), u[:, :, None] * u[:, None, :], accumulate=True)
    proj = torch.eye(G, dtype=mixes.dtype) - keep  # N_i
    nope = torch.einsum("igh,hicx->gicx", proj.to(wk.dtype), kp)  # (G, half, 2, D_2)
    k_nope = torch.empty_like(wk)
    k_nope[:, dims_a], k_nope[:, dims_b] = nope[:, :, 0], nope[:, :, 1]
    return q_rope.reshape(q_rope.shape[0], 2 * P, -1), k_rope.reshape(2 * P, -1), k_nope


# BKV (TransMLA's balanced K/V): before the joint SVD of [W_K; W_V], W_K is scaled by alpha = ||W_V L|| / ||W_K L||
# (L the activation whitening, or 1) so that neither block dominates the shared latent, and the key up-projection is
# divided by alpha afterwards (exact at full rank). It also makes the cut independent of how the model splits a score
# between W_Q and W_K (W_K c, W_Q / c give the same model and, with BKV, the same cut).
def kv_balance(wk: torch.Tensor, wv: torch.Tensor, whiten: torch.Tensor | None = None) -> float:
    """BKV's alpha = ||W_V L||_F / ||W_K L||_F (1 where either block is zero)."""
    nk = torch.linalg.norm(wk.to(F64) @ whiten if whiten is not None else wk.to(F64))
    nv = torch.linalg.norm(wv.to(F64) @ whiten if whiten is not None else wv.to(F64))
    if not (math.isfinite(float(nk)) and nk > 1e-12 * nv and nv > 1e-12 * nk):  # a (numerically) zero block
        return 1.0
    return float(nv / nk)


def captured_energy(energy: torch.Tensor, planes: torch.Tensor) -> float:
    """Fraction of the key energy that sits in the kept planes (energy (half, G) of the mixed planes)."""
    total = float(energy.sum())
    return float(energy[planes[:, 0], planes[:, 1]].sum()) / total if total > 0 else 0.0

"""GQA with RoPE -> MLA with DeepSeek's decoupled RoPE (lossy; MHA2MLA without training): gqa_to_mla_decoupled.

What keeps rotating (selection_options): each KV head's rotary pairs by frequency or 2-norm, its own part of the rope
key (rope_kv_heads = G, read by its own query heads only); or RoRoPE's planes mixed across KV heads (transforms.py),
read by every query head. The rest of the keys and the values go through lossy.py's joint SVD (`_svd_latent`).
"""
from __future__ import annotations

import torch

from ..modules import checks
from ..modules.gqa import GroupedQueryAttention
from ..modules.heads import kv_head_of
from ..modules.mla import MultiHeadLatentAttention
from ..modules.rope import RotaryEmbedding
from .base import F64, _bias, _expect, _gqa, _like, _set, copy_head_norms
from .linalg import input_covariance
from .lossy import _svd_latent
from .report import _report

ROPE_SELECTIONS = ("frequency", "norm", "rorope", "rorope-score")


def selection_options(rope_select: str = "frequency", balance: bool = False) -> dict:
    """gqa_to_mla_decoupled's keyword arguments for one name of what keeps rotating (the CLI's --rope-select).

    frequency / norm: per KV head, the fastest-turning pairs / the pairs with the largest |q||k|;
    rorope / rorope-score: RoRoPE's mixed planes, chosen by frequency / by score (transforms.select_planes).
    """
    if rope_select not in ROPE_SELECTIONS:
        raise ValueError(f"rope selection must be one of {', '.join(ROPE_SELECTIONS)}, got {rope_select!r}")
    if rope_select.startswith("rorope"):
        return {"rorope": True, "plane_order": "score" if rope_select.endswith("score") else "frequency",
                "balance": balance}
    return {"pair_selection": rope_select, "balance": balance}

def gqa_to_mla_decoupled(gqa: GroupedQueryAttention,
                         latent_dim: int,  # r, the latent of the keys that lose their rotation and the values
                         rope_pairs: int | None,  # pairs of each KV head's d/2 that keep rotating
                         *, calibration: torch.Tensor | None = None,  # inputs that whiten the SVD (needed by "norm")
                         pair_selection: str = "frequency",  # fastest pairs; "norm": largest mean |q||k| (MHA2MLA)
                         rorope: bool = False,  # mix each frequency's G key planes (transforms.py; exact); head_dim d
                         plane_order: str = "frequency",  # RoRoPE's planes by "frequency" or "score"
                         balance: bool = False,  # BKV: K and V balanced before the SVD (transforms.kv_balance)
                         context_len: int = 2048,  # the positions plane_order "score" weighs (transforms.select_planes)
                         rope_planes: int | None = None,  # RoRoPE planes kept (any number); None: G x rope_pairs
                         # RoRoPE: exactly these (P, 2) rows [pair, component], e.g. a layer of transforms.shared_planes
                         planes: torch.Tensor | None = None):
    """GQA with RoPE -> (MLA with DeepSeek's decoupled RoPE, ConversionReport), lossy (MHA2MLA without training).

    Kept pairs (or planes) become the rope key, exact in the scores; the rest lose their rotation and go with the
    values through `mha_to_mla`'s SVD. KV values a token: latent_dim + rope_dim (2 G rope_pairs or 2 rope_planes).
    Softmax scale kept. Per-head q/k norms need keys whole (check_keys_whole). Bad arguments raise ValueError.
    """
    normed = isinstance(gqa, GroupedQueryAttention) and gqa.k_head_norm is not None
    count = _checked_count(gqa, normed, rope_pairs, calibration, pair_selection, rorope, balance, rope_planes, planes)
    if rorope:
        return _decoupled_rorope(gqa, latent_dim, count, calibration, plane_order, balance, context_len, planes)
    return _decoupled_pairs(gqa, latent_dim, rope_pairs, calibration, pair_selection, balance, normed)


def _checked_count(gqa, normed: bool, rope_pairs, calibration, pair_selection: str, rorope: bool, balance: bool,
                   rope_planes, planes) -> int:
    """gqa_to_mla_decoupled's arguments checked (ValueError naming the value); the number of rotary planes or
    pairs kept over all KV heads."""
    _expect(gqa, GroupedQueryAttention, "gqa_to_mla_decoupled", carries=normed)
    if gqa.rope is None:
        raise ValueError("gqa_to_mla_decoupled needs a GQA with RoPE; use mha_to_mla for one without")
    if gqa.W_Q.bias is not None:
        raise ValueError("gqa_to_mla_decoupled does not carry biases yet")
    G, d = gqa.num_kv_heads, gqa.head_dim
    if normed:
        check_keys_whole(gqa, rope_pairs, rorope or rope_planes is not None or planes is not None, balance)
    if not rorope and (rope_planes is not None or planes is not None):
        raise ValueError("rope_planes and planes choose RoRoPE's mixed planes: they need rorope=True")
    if rorope and (rope_planes is not None or planes is not None):
        if rope_pairs is not None:
            raise ValueError("give rope_pairs or rope_planes/planes, not both")
        count = rope_planes if rope_planes is not None else int(planes.shape[0])
        checks.non_negative_int("rope_planes", count)
        if planes is not None and (planes.dim() != 2 or planes.shape[-1] != 2 or planes.shape[0] != count):
            raise ValueError(f"planes must be ({count}, 2) rows [pair, component], got {tuple(planes.shape)}")
        if count > G * d // 2:
            raise ValueError(f"rope_planes ({count}) must be at most the number of mixed planes, "
                             f"num_kv_heads x head_dim / 2 ({G * d // 2})")
    else:
        if rope_pairs is None:
            raise ValueError("give rope_pairs (per KV head), or with rorope=True rope_planes or planes")
        checks.non_negative_int("rope_pairs", rope_pairs)
        if rope_pairs >= d // 2 + bool(rorope or normed):
            raise ValueError(f"rope_pairs ({rope_pairs}) must be below head_dim / 2 ({d // 2}); "
                             "keeping every pair is the exact gqa_to_mla")
        count = G * rope_pairs
    if rorope:
        if pair_selection != "frequency":
            raise ValueError("rorope chooses mixed planes by plane_order; pair_selection applies without it")
        return count
    if pair_selection not in ("frequency", "norm"):
        raise ValueError(f"pair_selection must be 'frequency' or 'norm', got {pair_selection!r}")
    if pair_selection == "norm" and calibration is None:
        raise ValueError("pair_selection='norm' needs calibration inputs")
    return count


def _decoupled_pairs(gqa, latent_dim: int, rope_pairs: int, calibration, pair_selection: str, balance: bool,
                     normed: bool):
    """gqa_to_mla_decoupled without RoRoPE: each KV head's kept pairs (_kept_pairs) move into the rope key, the
    rest and the values through the latent's SVD."""
    H, G, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    half, n = d // 2, rope_pairs
    wq = gqa.W_Q.weight.detach().reshape(H, d, -1)  # (H, d, D_1)
    wk = gqa.W_K.weight.detach().reshape(G, d, -1)  # (G, d, D_2)
    owner = kv_head_of(H, G, gqa.grouping)
    first, second, kept = _kept_pairs(gqa, rope_pairs, pair_selection, calibration, wq, wk, owner)
    nope = []
    for g in range(G):
        rotary = torch.zeros(d, dtype=torch.bool)
        rotary[first[g]], rotary[second[g]] = True, True
        nope.append(torch.nonzero(~rotary).flatten())  # (d - 2n,)
    dn = d - 2 * n
    whole = normed  # every pair kept (check_keys_whole): no no-RoPE key, the latent holds the values alone

    # the keys that lose their rotation (none when whole: one zero key dim, so that the SVD factors W_V alone)
    nope_gqa = _gqa(gqa, G, bias=False, grouping=gqa.grouping, head_dim=dn or 1)
    nope_gqa.rope = None
    if not whole:
        _set(nope_gqa.W_Q, torch.stack([wq[h, nope[int(owner[h])]] for h in range(H)]).reshape(H * dn, -1))
        _set(nope_gqa.W_K, torch.stack([wk[g, nope[g]] for g in range(G)]).reshape(G * dn, -1))
    else:
        _set(nope_gqa.W_K, torch.zeros_like(nope_gqa.W_K.weight))
    _set(nope_gqa.W_V, gqa.W_V.weight)
    _set(nope_gqa.W_O, gqa.W_O.weight)
    base, values_exact = _svd_latent(nope_gqa, latent_dim, None, True, calibration, balance)[:2]  # no report

    p = 2 * G * n
    # each KV head's kept pairs are its own part of the rope key, read by its own query heads alone (the others'
    # rows of W_Q are zero): a rope key per KV head, whose expanded path dots d - 2n + 2n dims, not d - 2n + p
    per_head = dict(rope_kv_heads=G, rope_grouping=gqa.grouping) if p else {}
    options = {**per_head, **(gqa._head_config() if whole else {}), "softmax_scale": gqa.scale}  # the GQA's scale
    mla = MultiHeadLatentAttention(gqa.dim, H, latent_dim, head_dim=dn, v_head_dim=gqa.v_head_dim,
                                   context_dim=gqa.context_dim, rope_dim=p, **options, **_like(gqa))
    if p:  # slot g*n + k rotates like pair kept[g, k] of KV head g
        mla.rope = RotaryEmbedding(p, gqa.rope.base, inv_freq=gqa.rope.inv_freq[kept.reshape(-1)],
                                   scaling=gqa.rope.scaling)
    q = torch.zeros(H, dn + p, wq.shape[-1], dtype=wq.dtype, device=wq.device)
    kr = torch.zeros(p, wk.shape[-1], dtype=wk.dtype, device=wk.device)
    for h in range(H):
        g = int(owner[h])
        slots = torch.arange(g * n, (g + 1) * n)
        q[h, :dn] = wq[h, nope[g]]
        q[h, dn + slots], q[h, dn + slots + p // 2] = wq[h, first[g]], wq[h, second[g]]
        kr[slots], kr[slots + p // 2] = wk[g, first[g]], wk[g, second[g]]
    _set(mla.W_Q, q.reshape(H * (dn + p), -1))
    if p:
        _set(mla.W_KR, kr)
    for name in ("W_DKV", "W_UV", "W_O") + (() if whole else ("W_UK",)):
        _set(getattr(mla, name), getattr(base, name).weight, _bias(getattr(base, name)))
    notes = [f"rope pairs kept per KV head: {n} of {half} (by {pair_selection}); rope_dim {p}",
             f"latent r = {latent_dim}" + (", whitened by calibration" if calibration is not None else "")
             + (", K/V balanced" if balance else "")]
    if whole:  # KV head g's dims in the rope key, in its own rotary order: the kept pairs' first dims, then second
        copy_head_norms(mla, gqa)
        order = torch.cat([first[0], second[0]])  # the same pairs in every KV head
        with torch.no_grad():
            for norm in (mla.q_head_norm, mla.k_head_norm):
                norm.weight.copy_(norm.weight[order].clone())
        notes[0] = f"keys whole: every KV head's key is the rope key (rope_dim {p} = {G} x {d}), q/k norms carried"
    return mla, _report(gqa, mla, whole and values_exact, bases=False, calibration=calibration,
                        notes=notes)


def _kept_pairs(gqa, n: int, pair_selection: str, calibration, wq, wk, owner):
    """(first, second, kept), each (G, n): the two dims of each KV head's n kept rotary pairs, and the pairs, by
    frequency (the fastest) or by norm (the largest mean |q| |k| on the calibration inputs; wq (H, d, D), wk (G, d,
    D) and owner, each query head's KV head, as _decoupled_pairs has them)."""
    H, G, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    half = d // 2
    pairs = torch.arange(half)
    # the two dims of pair i within a head: (i, i + d/2) rotate-half, (2i, 2i+1) interleaved
    dims_a = pairs * 2 if gqa.rope.interleaved else pairs
    dims_b = dims_a + 1 if gqa.rope.interleaved else pairs + half
    if pair_selection == "frequency":
        kept = torch.argsort(gqa.rope.inv_freq, descending=True)[:n].sort().values.expand(G, n)  # (G, n)
    else:
        x = calibration.reshape(-1, calibration.shape[-1]).to(wk.dtype)
        q_all = (x @ wq.reshape(H * d, -1).T).reshape(-1, H, d)  # (N, H, d)
        k_all = (x @ wk.reshape(G * d, -1).T).reshape(-1, G, d)  # (N, G, d)
        pair_norm = lambda t: (t[..., dims_a] ** 2 + t[..., dims_b] ** 2).sqrt().mean(0)  # noqa: E731
        q_norm, k_norm = pair_norm(q_all), pair_norm(k_all)  # (H, half), (G, half)
        score = torch.stack([q_norm[owner == g].mean(0) * k_norm[g] for g in range(G)])  # (G, half)
        kept = torch.topk(score, n, dim=1).indices.sort(dim=1).values  # (G, n)
    return dims_a[kept], dims_b[kept], kept


# Keys whole (a module with per-head q/k norms: Qwen3, Gemma 3): every pair of every KV head keeps its rotation
# (rope_pairs = d/2, by frequency or norm, no RoRoPE), so the rope key is each KV head's whole key, normalised per KV
# head before RoPE as the GQA did (rope_kv_heads). The latent holds only the values, by the same SVD (exact at
# latent_dim = G x dv, or at the rank of W_V). The norms, softmax scale and sliding window are copied.
def check_keys_whole(gqa: GroupedQueryAttention, rope_pairs: int | None, mixed: bool, balance: bool) -> None:
    """ValueError naming rope_dim and G x d unless a conversion of this module with per-head q/k norms keeps
    each KV head's whole key as the rope key (the only decoupled layout a per-head key norm survives)."""
    G, d = gqa.num_kv_heads, gqa.head_dim
    what = f"a module with per-head q/k norms (qk_norm_eps={gqa.k_head_norm.eps}) converts only with its keys whole"
    need = f"rope_dim = G x d = {G} x {d} = {G * d} (rope_pairs {d // 2} per KV head)"
    if mixed:
        raise ValueError(f"{what}: {need}, each KV head's own pairs; RoRoPE mixes key planes across KV heads, "
                         "which a per-head key norm does not survive: use pair_selection 'frequency'")
    if rope_pairs != d // 2:
        got = "none" if rope_pairs is None else f"{2 * G * rope_pairs} (rope_pairs {rope_pairs})"
        raise ValueError(f"{what}: {need}, got rope_dim {got}")
    if balance:
        raise ValueError(f"{what} ({need}): the latent holds only the values, so there is nothing for BKV to "
                         "balance: balance=False")


def _rorope_mixes(gqa, calibration):
    """What RoRoPE reads of one layer: (wq, wk, owner, dims_a, dims_b, covariance, mixes, key energies)."""
    from .transforms import frequency_mixes, pair_dims

    H, G, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    wq = gqa.W_Q.weight.detach().to(F64).reshape(H, d, -1)  # (H, d, D_1)
    wk = gqa.W_K.weight.detach().to(F64).reshape(G, d, -1)  # (G, d, D_2)
    owner = kv_head_of(H, G, gqa.grouping)
    dims_a, dims_b = pair_dims(d, gqa.rope.interleaved)
    cov = None
    if calibration is not None:
        if calibration.shape[-1] != gqa.context_dim:
            raise ValueError(f"calibration has last dimension {calibration.shape[-1]}, expected {gqa.context_dim}")
        cov = input_covariance(calibration)  # (D_2, D_2), once per calibration tensor
    mixes, k_energy = frequency_mixes(wk, dims_a, dims_b, cov)  # (half, G, G), (half, G)
    return wq, wk, owner, dims_a, dims_b, cov, mixes, k_energy


def rorope_plane_scores(gqa: GroupedQueryAttention, calibration: torch.Tensor | None = None,
                        context_len: int = 2048) -> torch.Tensor:
    """(d/2, G): transforms.plane_scores of one layer's mixed planes, as plane_order "score" ranks them.

    What a whole-model conversion collects from every layer before transforms.shared_planes
    allocates the kept planes (cheap: the inputs' covariance and G x G eigenproblems).
    """
    from .transforms import mixed_query_energy, plane_scores

    _expect(gqa, GroupedQueryAttention, "rorope_plane_scores")
    if gqa.rope is None:
        raise ValueError("rorope_plane_scores needs a GQA with RoPE")
    wq, _, owner, dims_a, dims_b, cov, mixes, k_energy = _rorope_mixes(gqa, calibration)
    q_energy = mixed_query_energy(wq, owner, mixes, dims_a, dims_b, cov)
    return plane_scores(gqa.rope.inv_freq, k_energy, q_energy, context_len)


def _decoupled_rorope(gqa, latent_dim, count, calibration, plane_order, balance, context_len, planes=None):
    """gqa_to_mla_decoupled with RoRoPE: mixed key planes per frequency (transforms.py), kept ones rotate."""
    from .transforms import (
        captured_energy,
        mixed_query_energy,
        rorope_split,
        select_planes,
    )

    H, G, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    wq, wk, owner, dims_a, dims_b, cov, mixes, k_energy = _rorope_mixes(gqa, calibration)
    if planes is None:
        q_energy = mixed_query_energy(wq, owner, mixes, dims_a, dims_b, cov) if plane_order == "score" else None
        planes = select_planes(count, gqa.rope.inv_freq, k_energy, q_energy, order=plane_order,
                               context_len=context_len)  # (P, 2)
        how = plane_order
    else:
        planes = planes.to(torch.long)
        if bool((planes[:, 0] >= d // 2).any() | (planes[:, 1] >= G).any() | (planes < 0).any()) or \
                len({tuple(r) for r in planes.tolist()}) != planes.shape[0]:
            raise ValueError(f"planes must be distinct rows [pair < {d // 2}, component < {G}]")
        how = "given planes"
    q_rope, k_rope, k_nope = rorope_split(wq, wk, owner, mixes, planes, dims_a, dims_b)
    dt = gqa._anchor.dtype
    nope_gqa = _gqa(gqa, G, bias=False, grouping=gqa.grouping)
    nope_gqa.rope = None
    _set(nope_gqa.W_Q, gqa.W_Q.weight)
    _set(nope_gqa.W_K, k_nope.reshape(G * d, -1).to(dt))
    _set(nope_gqa.W_V, gqa.W_V.weight)
    _set(nope_gqa.W_O, gqa.W_O.weight)
    base = _svd_latent(nope_gqa, latent_dim, None, True, calibration, balance)[0]
    p = 2 * planes.shape[0]
    mla = MultiHeadLatentAttention(gqa.dim, H, latent_dim, head_dim=d, v_head_dim=gqa.v_head_dim,
                                   context_dim=gqa.context_dim, rope_dim=p, softmax_scale=gqa.scale, **_like(gqa))
    if p:  # slot s (and s + P) rotates like pair planes[s, 0]
        mla.rope = RotaryEmbedding(p, gqa.rope.base, inv_freq=gqa.rope.inv_freq[planes[:, 0]],
                                   scaling=gqa.rope.scaling)
        _set(mla.W_KR, k_rope.to(dt))
    _set(mla.W_Q, torch.cat([wq, q_rope], dim=1).reshape(H * (d + p), -1).to(dt))  # (H*(d+p), D_1)
    for name in ("W_DKV", "W_UK", "W_UV", "W_O"):
        _set(getattr(mla, name), getattr(base, name).weight, _bias(getattr(base, name)))
    notes = [f"RoRoPE: {planes.shape[0]} of {G * d // 2} mixed key planes rotate (by {how}), key energy "
             f"in them {captured_energy(k_energy, planes):.4f}; rope_dim {p}",
             f"latent r = {latent_dim}" + (", whitened by calibration" if calibration is not None else "")
             + (", K/V balanced" if balance else "")]
    return mla, _report(gqa, mla, False, bases=False, calibration=calibration, notes=notes)

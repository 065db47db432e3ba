"""Two calibrated-codec parts measured before building them into a storage, on SmolLM2's own keys and values:
keys coded per channel before RoPE (KVQuant) against after, 1% of them kept exact, and value codebooks (Lloyd-Max
levels of the normal, or fitted per layer on calibration text) against attnlab's uniform groups. Development texts
only.

    python benchmarks/quality/codec_parts.py     # prints a table, writes benchmarks/results/codec_parts.json

Keys: each KV head's keys per channel in b asymmetric bits over groups of 64 tokens (the "+c<b>" rope key, its range
searched), coded after RoPE as the cache does now, or before it and then rotated; the error is that of the scores
q.k of every causal query-key pair of the layer's heads, over the scores' variance, the mean over layers. Values:
each token's row of every KV head's values (192) turned by one random rotation, as the planner's latent is, then
coded b bits a value: attnlab's "int<b>/g256" (one searched range a row), or the nearest of 2^b levels times the
row's RMS and a searched multiplier, the levels the normal's Lloyd-Max ones (TurboQuant's) or fitted by Lloyd's
algorithm on the calibration text's rows of that layer; the error is the squared error over the values' energy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import finish, provenance, write_results  # noqa: E402
from texts import DEV_TEXTS, checked  # noqa: E402

from attnlab.modules import lowbit, turbo  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "codec_parts.json"
SCALES = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2)  # multipliers of a row's RMS tried, the best kept
LLOYD_STEPS = 60  # Lloyd's iterations for a fitted codebook (the levels stop moving well before)
FIT_SAMPLE = 200_000  # calibration values a layer's codebook is fitted on
OUTLIERS = 0.01  # the share of each key channel's values kept exact (KVQuant's 1%): 0.32 bits a value more


def projections(model, tok, name: str, tokens: int) -> dict:
    """{(kind, layer): (S, width)}: the q, k (before RoPE) and v projections of every layer on a dev text."""
    ids = tok(open(checked(DEV_TEXTS[name])).read(), return_tensors="pt").input_ids[:, :tokens]
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for kind in "qkv":
            proj = getattr(layer.self_attn, f"{kind}_proj")
            hooks.append(proj.register_forward_hook(lambda m, a, out, key=(kind, i): seen.__setitem__(key, out[0])))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def rotated(model, seen: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's q (H, S, d) and k (G, S, d) after RoPE, k before it, and RoPE's (cos, sin)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    q = seen["q", layer].view(-1, H, d).transpose(0, 1)[None]  # (1, H, S, d)
    k = seen["k", layer].view(-1, G, d).transpose(0, 1)[None]  # (1, G, S, d)
    cos, sin = model.model.rotary_emb(q, torch.arange(q.shape[-2])[None])
    q_rope, k_rope = apply_rotary_pos_emb(q, k, cos, sin)
    return q_rope[0], k_rope[0], k[0], (cos, sin)


def sparse_round_trip(k: torch.Tensor, fmt, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Keys (G, S, d) per channel with the values outside a channel's [lo, hi] (G, 1, d) kept exact and left out of
    the coded range (dense-and-sparse)."""
    outside = (k < lo) | (k > hi)
    return torch.where(outside, k, lowbit.channel_round_trip(k.clamp(lo, hi), fmt))


def key_errors(model, seen: dict, calibration: dict, bits: int) -> dict:
    """Mean over layers of the scores' squared error over their variance: keys coded after RoPE, before it, and after
    it with OUTLIERS of each channel's values (by the calibration text's quantiles) kept exact."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    fmt = lowbit.LowBit(f"c{bits}", bits, lowbit.KEY_TOKENS, True, "channel", search=True)
    sums = {"after": 0.0, "before": 0.0, "after, sparse": 0.0}
    for layer in range(cfg.num_hidden_layers):
        q, k_rope, k, (cos, sin) = rotated(model, seen, layer)
        c_rope = rotated(model, calibration, layer)[1]
        lo, hi = (torch.quantile(c_rope, f, dim=1, keepdim=True) for f in (OUTLIERS / 2, 1 - OUTLIERS / 2))
        S, d = q.shape[-2:]
        q = q.view(G, H // G, S, d)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores = torch.einsum("ghqd,gkd->ghqk", q, k_rope)[..., causal]
        coded = {"after": lowbit.channel_round_trip(k_rope, fmt),
                 "before": apply_rotary_pos_emb(q, lowbit.channel_round_trip(k, fmt)[None], cos, sin)[1][0],
                 "after, sparse": sparse_round_trip(k_rope, fmt, lo, hi)}
        for way, y in coded.items():
            error = torch.einsum("ghqd,gkd->ghqk", q, y - k_rope)[..., causal]
            sums[way] += float(error.pow(2).mean() / scores.var())
    return {way: total / cfg.num_hidden_layers for way, total in sums.items()}


def nearest_levels(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Rows x (N, W) read back from the nearest of `levels` times the row's RMS and the best of SCALES (its scale
    stored in float16)."""
    rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    edges = (levels[1:] + levels[:-1]) / 2
    best_err, best = None, None
    for m in SCALES:
        scale = (rms * m).half().float()
        y = levels[torch.searchsorted(edges, (x / scale).contiguous())] * scale
        err = (y - x).pow(2).sum(-1, keepdim=True)
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best_err = err if best_err is None else torch.where(better, err, best_err)
        best = y if best is None else torch.where(better, y, best)
    return best


def fitted_levels(u: torch.Tensor, count: int) -> torch.Tensor:
    """Lloyd's algorithm on the values u (n,): `count` levels, ascending, from u's quantiles."""
    c = torch.quantile(u, (torch.arange(count) + 0.5) / count)
    for _ in range(LLOYD_STEPS):
        cell = torch.searchsorted((c[1:] + c[:-1]) / 2, u)
        c = torch.stack([u[cell == j].mean() if (cell == j).any() else c[j] for j in range(count)])
    return c


def value_errors(calibration: dict, dev: dict, layers: int, bits: int) -> dict:
    """Mean over layers of the squared error over the energy of the rotated value rows, for each code."""
    width = dev["v", 0].shape[-1]
    turn, _ = torch.linalg.qr(torch.randn(width, width, generator=torch.Generator().manual_seed(0)))
    normal = torch.tensor(turbo.levels(bits), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    sums = {"int": 0.0, "lloyd-max": 0.0, "fitted": 0.0}
    for layer in range(layers):
        x, c = dev["v", layer] @ turn, calibration["v", layer] @ turn
        u = (c / c.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)).flatten()
        fitted = fitted_levels(u[torch.randperm(u.numel(), generator=gen)[:FIT_SAMPLE]], 1 << bits)
        energy = x.pow(2).sum()
        coded = {"int": lowbit.round_trip(x, (width,), lowbit.parse(f"int{bits}/g256")),
                 "lloyd-max": nearest_levels(x, normal), "fitted": nearest_levels(x, fitted)}
        for way, y in coded.items():
            sums[way] += float((y - x).pow(2).sum() / energy)
    return {way: total / layers for way, total in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="mpl", choices=sorted(DEV_TEXTS))
    ap.add_argument("--text", default="argparse", choices=sorted(DEV_TEXTS))
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    prov = provenance(sys.argv, results=(str(RESULTS.relative_to(ROOT)),))
    from attnlab.models import load_smollm2

    torch.manual_seed(0)
    model, tok = load_smollm2()
    dev, calibration = (projections(model, tok, name, args.tokens) for name in (args.text, args.calibration))
    rows = []
    for bits in (4, 3, 2):
        keys = key_errors(model, dev, calibration, bits)
        values = value_errors(calibration, dev, model.config.num_hidden_layers, bits)
        rows.append({"bits": bits, "keys": keys, "values": values})
        print(f"{bits} bits | keys after RoPE {keys['after']:.5f}, before {keys['before']:.5f} "
              f"({keys['before'] / keys['after']:.3f}x), 1% exact {keys['after, sparse']:.5f} | values int "
              f"{values['int']:.5f}, Lloyd-Max "
              f"{values['lloyd-max']:.5f} ({values['lloyd-max'] / values['int']:.3f}x), fitted {values['fitted']:.5f} "
              f"({values['fitted'] / values['int']:.3f}x)")
    out = {"what": __doc__.splitlines()[0], "model": "smollm2", "text": args.text, "calibration": args.calibration,
           "tokens": args.tokens, "rows": rows, "provenance": finish(prov)}
    write_results(RESULTS, out)


if __name__ == "__main__":
    main()
